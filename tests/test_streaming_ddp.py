"""The seq2seq example streaming a shard directory with 2 processes: equal batches on both ranks, each
validation pair scored once, and a run interrupted in the middle of an epoch that resumes exactly.

The uninterrupted 2-epoch run is the reference. The same run, held at a step of epoch 1 and sent SIGTERM
through the launcher, then resumed by the same command, must train on exactly the batches the reference
trained on after that step, in the same order, and end with bit-for-bit its parameters. So must the same run
under torchrun with a checkpoint every few steps, one of whose workers is killed a few steps after the
checkpoint in the middle of epoch 1: torchrun restarts the workers, which resume from that checkpoint.
"""

import json
import math
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from scripts import make_shards
from tests.helpers import (
    copy_project,
    finish,
    free_port,
    launch,
    run_script,
    torchrun_workers,
    wait_for_hold,
    write_pairs,
)
from training.checkpoints.preemption import CHECK_PERIOD

pytestmark = pytest.mark.distributed

BATCH = 16
EPOCHS = 2
# Every step sleeps at least this long, so the ranks agree on stopping within 40 steps of the signal: with
# HOLD_STEP 10 steps into epoch 1, the run stops in the middle of epoch 1 however fast the machine is.
PACE = CHECK_PERIOD / 40
SMALL = [
    "--trainer.accelerator=cpu",
    f"--trainer.max_epochs={EPOCHS}",
    f"--data.init_args.batch_size={BATCH}",
    "--data.init_args.val_fraction=0.045",
    "--model.init_args.d_model=32",
    "--model.init_args.num_encoder_layers=1",
    "--model.init_args.num_decoder_layers=1",
    "--model.init_args.dim_feedforward=64",
    "--model.init_args.dropout=0.1",  # resumed random states matter
    "--model.init_args.warmup_steps=10",
    "--trainer.callbacks+=tests.helpers.probe.SlowDown",
    f"--trainer.callbacks.seconds={PACE}",
    "--trainer.callbacks.progress_file=progress.step",
]
# Under torchrun, last.ckpt every this many steps (epoch 0 has 60): the first checkpoint of epoch 1 is at step 75.
CHECKPOINT_EVERY = 25


def logged(name: str) -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.probe.BatchLog", f"--trainer.callbacks.out_dir={name}"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The project with a shard directory of 2,003 pairs: 1,914 to train on, which 2 ranks of 16 do not divide,
    and 79 to validate on, which 2 ranks do not divide."""
    project = copy_project(tmp_path_factory.mktemp("project"))
    pairs = write_pairs(project / "pairs.tsv", 2003)
    assert make_shards.main([str(pairs), str(project / "shards"), "--shard-size=300", "--val-fraction=0.045"]) == 0
    return project


def fit(project: Path, run_id: str, *args: str) -> str:
    cli = [str(project / "cli.py"), "fit", "-c", "configs/ddp.yaml", "-c", "configs/seq2seq.yaml"]
    command = [*cli, "--trainer.devices=2", "--data.init_args.path=shards", *SMALL, *args]
    result = run_script(command, cwd=project, env={"RUN_ID": run_id})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def make_index(project: Path) -> dict:
    return json.loads((project / "shards" / "index.json").read_text())


def batch_logs(directory: Path) -> list[dict]:
    return [torch.load(directory / f"batches{rank}.pt") for rank in range(2)]


def last_checkpoint(project: Path, run_id: str) -> dict:
    return torch.load(project / "logs" / "seq2seq" / run_id / "checkpoints" / "last.ckpt", weights_only=True)


def held_at(step: int, hold: Path) -> list[str]:
    return [
        "--trainer.callbacks+=tests.helpers.probe.HoldAtStep",
        f"--trainer.callbacks.step={step}",
        f"--trainer.callbacks.hold_file={hold}",
    ]


def wait_for_checkpoint(project: Path, run_id: str, step: int, process, timeout: float = 600) -> None:
    """Wait until the run's last.ckpt (renamed into place once written whole) is the one of ``step``."""
    path = project / "logs" / "seq2seq" / run_id / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + timeout
    while not (path.exists() and last_checkpoint(project, run_id)["global_step"] == step):
        assert process.poll() is None, (
            f"the run ended before its checkpoint of step {step}:\n{process.communicate()[0]}"
        )
        assert time.monotonic() < deadline, f"no checkpoint of step {step} within {timeout} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference(project):
    fit(project, "whole", *logged("whole"))
    return batch_logs(project / "whole"), last_checkpoint(project, "whole")


@pytest.fixture(scope="module")
def resumed(project, reference):
    """Held 10 steps into epoch 1 and sent SIGTERM through the launcher, then run again by the same command."""
    first_epoch_steps = sum(epoch == 0 for _, epoch, _ in reference[0][0]["batches"])
    hold = project / "sigterm.hold"
    hold.touch()
    args = [*SMALL, "--data.init_args.path=shards", *held_at(first_epoch_steps + 10, hold)]
    settings = {"RUN_ID": "interrupted", "MASTER_PORT": str(free_port())}
    process = launch(project, "cpu:2", 0, *args, CONFIGS="configs/ddp.yaml configs/seq2seq.yaml", **settings)
    wait_for_hold(hold, 2, process)
    process.send_signal(signal.SIGTERM)
    finish(process)
    hold.unlink()
    stopped_at = last_checkpoint(project, "interrupted")["global_step"]
    output = fit(project, "interrupted", *logged("resumed"))
    return stopped_at, output, batch_logs(project / "resumed"), last_checkpoint(project, "interrupted")


@pytest.fixture(scope="module")
def restarted(project, reference):
    """Under torchrun with a checkpoint every CHECKPOINT_EVERY steps; one worker killed (SIGKILL) while the ranks
    hold 3 steps after the first checkpoint of epoch 1. torchrun restarts both workers, which resume from it."""
    first_epoch_steps = sum(epoch == 0 for _, epoch, _ in reference[0][0]["batches"])
    checkpoint_step = (first_epoch_steps // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY
    # The ModelCheckpoint of configs/ddp.yaml, a list entry, is set in a copy of that file.
    every = "every_n_train_steps: null"
    ddp = (project / "configs" / "ddp.yaml").read_text()
    assert every in ddp
    steps = project / "configs" / "ddp_step_checkpoints.yaml"
    steps.write_text(ddp.replace(every, f"every_n_train_steps: {CHECKPOINT_EVERY}"))
    hold = project / "kill.hold"
    hold.touch()
    args = [*SMALL, "--data.init_args.path=shards", *held_at(checkpoint_step + 3, hold), *logged("restarted")]
    settings = {"RUN_ID": "restarted", "MASTER_PORT": str(free_port()), "LAUNCHER": "torchrun", "MAX_RESTARTS": "1"}
    configs = f"{steps.relative_to(project)} configs/seq2seq.yaml"
    process = launch(project, "cpu:2", 0, *args, CONFIGS=configs, **settings)
    wait_for_hold(hold, 2, process)
    wait_for_checkpoint(project, "restarted", checkpoint_step, process)
    workers = torchrun_workers(project)
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGKILL)
    hold.unlink()
    output = finish(process)  # status 0
    # BatchLog writes at the end of training: only the restarted workers, which trained to the end, wrote.
    return checkpoint_step, output, batch_logs(project / "restarted"), last_checkpoint(project, "restarted")


def test_every_rank_trains_the_same_number_of_batches_and_all_pairs_once_every_epoch(project, reference):
    logs, _ = reference
    assert [log["world_size"] for log in logs] == [2, 2]
    num_train = sum(make_index(project)["train"])
    assert num_train % (2 * BATCH) != 0 and num_train % 2 == 0  # a partial last step, which 2 ranks share whole
    for epoch in range(EPOCHS):
        batches = [[ids for _, e, ids in log["batches"] if e == epoch] for log in logs]
        assert len(batches[0]) == len(batches[1]) == math.ceil(num_train / 2 / BATCH)
        counts = Counter(i for rank in batches for ids in rank for i in ids)
        assert sorted(counts) == list(range(num_train)) and set(counts.values()) == {1}


def test_a_run_stopped_mid_epoch_resumes_with_the_batches_and_weights_of_the_uninterrupted_run(reference, resumed):
    (whole, final), (stopped_at, output, after, resumed_final) = reference, resumed
    steps_per_epoch = final["global_step"] // EPOCHS
    assert steps_per_epoch < stopped_at < 2 * steps_per_epoch, "the signal did not stop the run mid-epoch"
    assert f"(epoch 1, step {stopped_at})" in output
    for rank in range(2):
        expected = [batch for batch in whole[rank]["batches"] if batch[0] >= stopped_at]
        assert after[rank]["batches"] == expected, f"rank {rank} trained on other batches after the resume"
    assert resumed_final["global_step"] == final["global_step"]
    for name, value in final["state_dict"].items():
        assert torch.equal(resumed_final["state_dict"][name], value), name


def test_a_worker_killed_under_torchrun_resumes_from_a_mid_epoch_checkpoint_exactly(reference, restarted):
    (whole, final), (checkpoint_step, output, after, restarted_final) = reference, restarted
    steps_per_epoch = final["global_step"] // EPOCHS
    assert steps_per_epoch < checkpoint_step < 2 * steps_per_epoch, "the checkpoint is not from the middle of epoch 1"
    assert "will restart worker group" in output
    assert output.count("Resuming from") == 1 and f"(epoch 1, step {checkpoint_step})." in output
    for rank in range(2):
        expected = [batch for batch in whole[rank]["batches"] if batch[0] >= checkpoint_step]
        assert after[rank]["batches"] == expected, f"rank {rank} trained on other batches after the restart"
    assert restarted_final["global_step"] == final["global_step"]
    for name, value in final["state_dict"].items():
        assert torch.equal(restarted_final["state_dict"][name], value), name


def test_validation_over_two_ranks_scores_each_pair_once(project, reference, run_cli):
    assert sum(make_index(project)["val"]) % 2 == 1  # odd: a repeated pair would even the ranks out
    events = EventAccumulator(str(project / "logs" / "seq2seq" / "whole"))
    events.Reload()
    checkpoint = project / "logs" / "seq2seq" / "whole" / "checkpoints" / "last.ckpt"
    single = run_cli(
        "validate",
        "-c",
        str(project / "configs" / "ddp.yaml"),
        "-c",
        str(project / "configs" / "seq2seq.yaml"),
        *SMALL[:-3],
        "--trainer.strategy=auto",
        "--trainer.devices=1",
        "--trainer.logger=false",
        f"--data.init_args.path={project / 'shards'}",
        f"--ckpt_path={checkpoint}",
    )
    for name in ("val/loss", "val/token_acc", "val/exact_match"):
        gathered = events.Scalars(name)[-1].value
        assert gathered == pytest.approx(single.trainer.callback_metrics[name].item(), rel=1e-5), name
