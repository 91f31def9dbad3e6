"""Auto-resume, preemption, elastic restarts and atomic checkpoints.

Every 2-process run trains the toy model with dropout for 3 epochs of 64 steps. The uninterrupted run is the
reference. One run, interrupted three ways in turn, must end with exactly its parameters: stopped at the end
of epoch 0, resumed and stopped by SIGTERM in the middle of epoch 1, resumed under torchrun and hit by a
killed worker in epoch 2, which torchrun restarts from the checkpoint at the end of epoch 1.
"""

import logging
import multiprocessing
import multiprocessing.synchronize
import os
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from tests.helpers import (
    DDP_YAML,
    SINGLE_PROCESS,
    assert_everything_stopped,
    copy_project,
    finish,
    free_port,
    launch,
    run_script,
    torchrun_workers,
    wait_for_hold,
)
from training.callbacks.progress_bar import ProgressBar
from training.checkpoints.atomic_io import AtomicCheckpointIO
from training.checkpoints.preemption import CHECK_PERIOD, PreemptionCheckpoint

STEPS_PER_EPOCH = 64  # 8192 samples / (64 per batch * 2 processes)
EPOCHS = 3
# Every step sleeps at least this long, so the ranks agree on stopping at most every CHECK_PERIOD / PACE steps
# after a signal: 40, which keeps a signal at step SIGTERM_STEP inside epoch 1 however fast the machine is.
PACE = CHECK_PERIOD / 40
SIGTERM_STEP = STEPS_PER_EPOCH + 10
KILL_STEP = 2 * STEPS_PER_EPOCH + 10
RUN = "interrupted"


def test_a_stop_is_agreed_within_the_check_period_even_when_the_first_batch_was_fast(monkeypatch):
    # The first batch is timed without the work callbacks after PreemptionCheckpoint do (1 ms here); every
    # later one takes PACE. The agreement period must not be set by that first batch.
    clock = [0.0]
    monkeypatch.setattr("training.checkpoints.preemption.time.monotonic", lambda: clock[0])
    epoch_loop = SimpleNamespace(_broadcast_sigterm_tensor=None)
    trainer = SimpleNamespace(
        world_size=1,
        num_nodes=1,
        node_rank=0,
        fit_loop=SimpleNamespace(epoch_loop=epoch_loop),
        strategy=SimpleNamespace(launcher=None),
        received_sigterm=False,
    )
    callback = PreemptionCheckpoint()
    callback.on_train_start(trainer, None)
    try:
        clock[0] += 0.001
        for batch in range(1, 400):
            if batch == 100:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler PreemptionCheckpoint installed notes it
            try:
                callback.on_train_batch_end(trainer, None, None, None, batch)
            except SIGTERMException:
                break
            clock[0] += PACE
    finally:
        callback.on_train_end(trainer, None)
    assert 100 <= batch <= 100 + CHECK_PERIOD / PACE, f"stopped {batch - 100} batches after the signal"


def test_the_stop_paragraph_starts_on_a_line_of_its_own_after_a_progress_bar(tmp_path, caplog):
    saved = []
    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    checkpoint.last_model_path = str(tmp_path / "last.ckpt")
    trainer = SimpleNamespace(
        checkpoint_callback=checkpoint,
        save_checkpoint=lambda path, weights_only: saved.append(path),
        current_epoch=1,
        global_step=74,
        num_nodes=1,
        progress_bar_callback=ProgressBar(),  # its line stays open, without a newline, until it is drawn again
    )
    with caplog.at_level(logging.INFO):
        PreemptionCheckpoint().on_exception(trainer, None, SIGTERMException())
    assert saved == [checkpoint.last_model_path]
    assert caplog.messages[-1].startswith(f"\nStopped by a signal at epoch 1, step 74: saved {tmp_path}/last.ckpt.")


def run_args(epochs: int = EPOCHS, hold_at: int | None = None, hold_file: Path | None = None) -> list[str]:
    args = [
        f"--trainer.max_epochs={epochs}",
        "--model.init_args.dropout=0.2",
        "--trainer.callbacks+=tests.helpers.probe.SlowDown",
        f"--trainer.callbacks.seconds={PACE}",
        "--trainer.callbacks.progress_file=progress.step",
    ]
    if hold_at is not None:
        args += [
            "--trainer.callbacks+=tests.helpers.probe.HoldAtStep",
            f"--trainer.callbacks.step={hold_at}",
            f"--trainer.callbacks.hold_file={hold_file}",
        ]
    return args


def last_checkpoint(project: Path, run_id: str) -> dict:
    return torch.load(project / "logs" / "toy" / run_id / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return copy_project(tmp_path_factory.mktemp("project"))


@pytest.fixture(scope="module")
def port():
    return str(free_port())


def fit(project: Path, run_id: str, *args: str) -> str:
    """``python cli.py fit`` with 2 CPU processes, started without the launcher, which the later stages test."""
    cli = [str(project / "cli.py"), "fit", "-c", "configs/ddp.yaml", "--trainer.accelerator=cpu", "--trainer.devices=2"]
    result = run_script([*cli, *args], cwd=project, env={"RUN_ID": run_id})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def reference(project):
    fit(project, "whole", *run_args())
    return last_checkpoint(project, "whole")


@pytest.fixture(scope="module")
def first_epoch(project):
    """The run trained for one epoch only: it stops at an epoch boundary."""
    return fit(project, RUN, *run_args(epochs=1))


@pytest.fixture(scope="module")
def preempted(project, port, first_epoch):
    """The same command for 3 epochs, sent SIGTERM while its ranks hold at SIGTERM_STEP."""
    hold = project / "sigterm.hold"
    hold.touch()
    process = launch(project, "cpu:2", 0, *run_args(hold_at=SIGTERM_STEP, hold_file=hold), RUN_ID=RUN, MASTER_PORT=port)
    wait_for_hold(hold, 2, process)
    process.send_signal(signal.SIGTERM)
    output = finish(process)  # a clean exit: status 0
    hold.unlink()
    return output, last_checkpoint(project, RUN)


@pytest.fixture(scope="module")
def restarted(project, port, preempted):
    """The same command under torchrun; a worker is killed while the ranks hold at KILL_STEP."""
    hold = project / "kill.hold"
    hold.touch()
    args = run_args(hold_at=KILL_STEP, hold_file=hold)
    process = launch(project, "cpu:2", 0, *args, RUN_ID=RUN, MASTER_PORT=port, LAUNCHER="torchrun")
    wait_for_hold(hold, 2, process)
    workers = torchrun_workers(project)
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGKILL)
    hold.unlink()
    return finish(process)


def assert_same_parameters(checkpoint: dict, reference: dict) -> None:
    assert checkpoint["global_step"] == reference["global_step"] == EPOCHS * STEPS_PER_EPOCH
    for name, value in reference["state_dict"].items():
        assert torch.equal(checkpoint["state_dict"][name], value), name


def resumed(output: str, run: str, epoch: int, step: int) -> list[str]:
    """The lines saying that the run resumed from its last.ckpt at ``epoch`` and ``step``."""
    pattern = rf"Resuming from \S*/logs/toy/{run}/checkpoints/last\.ckpt \(epoch {epoch}, step {step}\)\."
    return re.findall(pattern, output)


@pytest.mark.distributed
def test_a_run_stopped_at_an_epoch_boundary_resumes_from_there(first_epoch, preempted):
    assert "Resuming" not in first_epoch
    output, _ = preempted
    assert len(resumed(output, RUN, epoch=0, step=STEPS_PER_EPOCH)) == 1


@pytest.mark.distributed
def test_sigterm_to_the_launcher_saves_a_checkpoint_mid_epoch_and_stops_every_process(project, port, preempted):
    output, saved = preempted
    step = saved["global_step"]
    assert SIGTERM_STEP <= step < 2 * STEPS_PER_EPOCH, "the checkpoint is not from where the signal arrived"
    assert "terminated, stopping training: sending SIGTERM to" in output
    stop = f"Stopped by a signal (SIGTERM) at epoch 1, step {step}: saved logs/toy/{RUN}/checkpoints/last.ckpt"
    assert stop in output
    assert "still running after" not in output, "training ignored the signal and was killed"
    assert not list((project / "logs" / "toy" / RUN / "checkpoints").glob(".*.partial"))
    assert_everything_stopped(project, port)


@pytest.mark.distributed
def test_a_killed_worker_is_restarted_by_torchrun_and_resumes(preempted, restarted):
    _, saved = preempted
    assert len(resumed(restarted, RUN, epoch=1, step=saved["global_step"])) == 1, "the preempted run"
    assert "will restart worker group" in restarted
    assert len(resumed(restarted, RUN, epoch=1, step=2 * STEPS_PER_EPOCH)) == 1, "the restart"
    assert "not resumable" not in restarted
    assert "connectFullMesh" not in restarted


@pytest.mark.distributed
def test_the_interrupted_run_ends_with_the_parameters_of_the_uninterrupted_one(project, reference, restarted):
    assert_same_parameters(last_checkpoint(project, RUN), reference)
    assert sorted(p.name for p in (project / "logs" / "toy").iterdir()) == sorted(["whole", RUN])


def test_rerunning_a_finished_run_trains_nothing_and_says_so(run_cli, caplog):
    args = ["fit", "-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.max_epochs=1", "--trainer.limit_train_batches=4"]
    finished = run_cli(*args).trainer.global_step
    caplog.clear()
    with caplog.at_level(logging.INFO):
        rerun = run_cli(*args)
    assert finished == rerun.trainer.global_step == 4
    output = caplog.text
    assert len(resumed(output, "default", epoch=0, step=4)) == 1
    assert "Nothing to train: the run in logs/toy/default already reached its end" in output


def save_then_stop_before_the_rename(target: Path, stopped: multiprocessing.synchronize.Event) -> None:
    """Save step 1, then write step 2 in full and stop just before renaming it into place, where a kill leaves
    the most behind: a complete .partial file next to the previous checkpoint."""
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1, "weights": torch.full((1000,), 1.0)}, target)

    def stop(fd: int) -> None:
        stopped.set()
        time.sleep(3600)

    os.fsync = stop  # in the forked writer only
    io.save_checkpoint({"step": 2, "weights": torch.full((1000,), 2.0)}, target)


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    target = tmp_path / "checkpoints" / "last.ckpt"
    partial = target.with_name(".last.ckpt.partial")
    fork = multiprocessing.get_context("fork")
    stopped = fork.Event()
    writer = fork.Process(target=save_then_stop_before_the_rename, args=(target, stopped))
    writer.start()
    try:
        while not stopped.wait(0.05):
            assert writer.is_alive(), "the writer ended before its second save"
    finally:
        writer.kill()
        writer.join()
    checkpoint = torch.load(target, weights_only=True)
    assert checkpoint["step"] == 1 and torch.equal(checkpoint["weights"], torch.full((1000,), 1.0))
    assert torch.load(partial, weights_only=True)["step"] == 2, "the second save was not written in full"

    AtomicCheckpointIO().save_checkpoint({"step": 3}, target)
    assert torch.load(target, weights_only=True) == {"step": 3}
    assert not partial.exists(), "the next save did not take over the file a kill left"
