"""Checkpoints written in the background (``AtomicCheckpointIO(background=True)``, configs/ddp.yaml): the windows
where a kill or the end of the run meets a write that is still going on."""

import logging
import multiprocessing
import multiprocessing.synchronize
import re
import threading
import time
from pathlib import Path

import torch

from benchmarks import checkpoint_save
from tests.helpers import DDP_YAML, SINGLE_PROCESS
from training.checkpoints.atomic_io import AtomicCheckpointIO
from training.config.trainer_settings import combination_problem


def state(step: int) -> dict:
    return {"global_step": step, "weights": torch.full((1000,), float(step))}


def stop_while_writing_the_next_best(directory: Path, events: dict[str, multiprocessing.synchronize.Event]) -> None:
    """Save step 1 (best and last) in full; then, as ModelCheckpoint does at the next epoch's end, ask for the new
    best, the removal of the previous best and the new last, with the writer stopped inside the first write."""
    io = AtomicCheckpointIO(background=True)
    io.save_checkpoint(state(1), directory / "best-1.ckpt")
    io.save_checkpoint(state(1), directory / "last.ckpt")
    io.wait()

    def stop(checkpoint: dict, file) -> None:
        events["writing"].set()
        time.sleep(3600)

    torch.save = stop  # in the forked process only
    io.save_checkpoint(state(2), directory / "best-2.ckpt")
    io.remove_checkpoint(directory / "best-1.ckpt")
    io.save_checkpoint(state(2), directory / "last.ckpt")
    events["asked"].set()
    time.sleep(3600)


def test_a_kill_during_a_background_write_leaves_the_previous_checkpoints_loadable(tmp_path):
    fork = multiprocessing.get_context("fork")
    events = {"writing": fork.Event(), "asked": fork.Event()}
    process = fork.Process(target=stop_while_writing_the_next_best, args=(tmp_path, events))
    process.start()
    try:
        while not (events["writing"].wait(0.05) and events["asked"].wait(0.05)):
            assert process.is_alive(), "the process ended before its second saves"
    finally:
        process.kill()
        process.join()
    for name in ("best-1.ckpt", "last.ckpt"):  # the removal waited behind the write the kill interrupted
        assert torch.load(tmp_path / name, weights_only=True)["global_step"] == 1, name
    assert not (tmp_path / "best-2.ckpt").exists()


def test_a_run_ends_after_its_last_write_and_resumes_from_its_newest_complete_checkpoint(run_cli, tmp_path, caplog):
    plugin = tmp_path / "held.yaml"
    plugin.write_text("trainer:\n  plugins:\n    - class_path: tests.helpers.probe.SavesAfterTrainingEnds\n")
    args = ["fit", "-c", DDP_YAML, "-c", str(plugin), *SINGLE_PROCESS, "--trainer.limit_train_batches=4"]
    args += ["--trainer.limit_val_batches=2", "--trainer.callbacks+=tests.helpers.probe.ReleaseSaves"]
    run_cli(*args, "--trainer.max_epochs=1")
    # The writes could only begin once training had ended: the run returned after they were complete.
    checkpoints = tmp_path / "logs" / "toy" / "default" / "checkpoints"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 4
    assert len(list(checkpoints.glob("epoch000-*.ckpt"))) == 1

    # A newer save that a kill cut short: the resume takes the newest complete checkpoint instead.
    partial = checkpoints / ".last.ckpt.partial"
    partial.write_bytes((checkpoints / "last.ckpt").read_bytes()[:1000])
    with caplog.at_level(logging.INFO):
        run_cli(*args, "--trainer.max_epochs=2")
    assert re.search(r"Resuming from \S*/logs/toy/default/checkpoints/last\.ckpt \(epoch 0, step 4\)\.", caplog.text)
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 8
    assert not partial.exists(), "the next write took over the file the kill left"


def test_the_benchmark_measures_both_ways(tmp_path, capsys):
    result = checkpoint_save.main(["--megabytes", "2", "--rounds", "3", "--dir", str(tmp_path)])
    for way in ("in the step", "background"):
        assert 0 < result[way]["blocked_s"] <= result[way]["written_s"] and result[way]["first_blocked_s"] > 0, way
    assert result["ratio"] == result["background"]["blocked_s"] / result["in the step"]["blocked_s"]
    out = capsys.readouterr().out
    assert f"background/in-the-step blocked time: {result['ratio']:.3f} (goal at most 0.20: " in out
    assert list(tmp_path.iterdir()) == [], "a round left its files behind"


def test_a_link_as_last_checkpoint_with_background_writes_is_refused():
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": "link"}}
    io = {"class_path": "training.AtomicCheckpointIO", "init_args": {"background": True}}
    problem = combination_problem({"trainer": {"callbacks": [checkpoint], "plugins": [io]}})
    assert problem.startswith("a ModelCheckpoint with save_last: link makes last.ckpt a link to the newest checkpoint")
    assert problem.endswith("or background: false on the AtomicCheckpointIO entry of trainer.plugins.")
    io["init_args"]["background"] = False
    assert combination_problem({"trainer": {"callbacks": [checkpoint], "plugins": [io]}}) is None


def test_a_checkpoint_written_in_the_background_counts_as_saved_only_once_it_is_on_disk(tmp_path, monkeypatch):
    # What a lost node's paragraph names as the last complete checkpoint (DDPStrategy's barrier) comes from here.
    release, counted, written = threading.Event(), threading.Event(), []
    io = AtomicCheckpointIO(background=True)
    write = io.write
    monkeypatch.setattr(io, "write", lambda *args: release.wait(600) and write(*args))
    io.save_checkpoint(state(1), tmp_path / "last.ckpt")
    io.when_written(lambda: (written.append((tmp_path / "last.ckpt").exists()), counted.set()))
    assert not counted.wait(0.5) and written == []
    release.set()
    assert counted.wait(600) and written == [True]
    io.wait()
    io.when_written(lambda: written.append("at once"))  # nothing pending
    assert written == [True, "at once"]
    io.teardown()
