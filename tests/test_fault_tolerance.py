"""Auto-resume, preemption, elastic restarts and atomic checkpoints.

Every 2-process run trains the toy model with dropout for 3 epochs of 64 steps. The uninterrupted run is the
reference: runs stopped at an epoch boundary, by SIGTERM in the middle of an epoch, or by a killed worker
under torchrun must end with exactly its parameters.
"""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.cluster import finish, launch, processes_in, wait_for_step
from tests.conftest import DDP_YAML, SINGLE_PROCESS, copy_project, free_port

pytestmark = pytest.mark.distributed

STEPS_PER_EPOCH = 64  # 8192 samples / (64 per batch * 2 processes)
EPOCHS = 3


def run_args(project: Path, run_id: str, epochs: int = EPOCHS) -> list[str]:
    return [
        f"--trainer.max_epochs={epochs}",
        "--trainer.enable_progress_bar=false",
        "--model.init_args.dropout=0.2",
        "--trainer.callbacks+=tests.probe.SlowDown",
        "--trainer.callbacks.seconds=0.01",
        f"--trainer.callbacks.progress_file={progress_file(project, run_id)}",
    ]


def progress_file(project: Path, run_id: str) -> Path:
    return project / f"{run_id}.step"


def last_checkpoint(project: Path, run_id: str) -> dict:
    return torch.load(project / "logs" / "toy" / run_id / "checkpoints" / "last.ckpt", weights_only=True)


def assert_same_parameters(checkpoint: dict, reference: dict) -> None:
    assert checkpoint["global_step"] == reference["global_step"] == EPOCHS * STEPS_PER_EPOCH
    for name, value in reference["state_dict"].items():
        assert torch.equal(checkpoint["state_dict"][name], value), name


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return copy_project(tmp_path_factory.mktemp("project"))


def train(project: Path, run_id: str, epochs: int = EPOCHS, **settings: str) -> str:
    process = launch(project, "cpu:2", 0, *run_args(project, run_id, epochs), RUN_ID=run_id, **settings)
    return finish(process)


@pytest.fixture(scope="module")
def reference(project):
    train(project, "whole", MASTER_PORT=str(free_port()))
    return last_checkpoint(project, "whole")


def test_resuming_at_an_epoch_boundary_repeats_the_uninterrupted_run(project, reference):
    port = str(free_port())
    first = train(project, "split", epochs=1, MASTER_PORT=port)
    assert "Resuming" not in first
    second = train(project, "split", MASTER_PORT=port)
    assert f"Resuming from logs/toy/split/checkpoints/last.ckpt (epoch 0, step {STEPS_PER_EPOCH})" in second
    assert_same_parameters(last_checkpoint(project, "split"), reference)
    assert sorted(p.name for p in (project / "logs" / "toy").iterdir()) == sorted(["whole", "split"])


def test_sigterm_saves_a_checkpoint_mid_epoch_and_the_rerun_continues_it_exactly(project, reference):
    port = str(free_port())
    process = launch(project, "cpu:2", 0, *run_args(project, "preempted"), RUN_ID="preempted", MASTER_PORT=port)
    wait_for_step(progress_file(project, "preempted"), STEPS_PER_EPOCH + 10)
    process.send_signal(signal.SIGTERM)
    output = finish(process)  # a clean exit: status 0
    saved = last_checkpoint(project, "preempted")
    step = saved["global_step"]
    assert STEPS_PER_EPOCH < step < 2 * STEPS_PER_EPOCH, "the checkpoint is not from the middle of epoch 1"
    assert f"Stopped by a signal at epoch 1, step {step}: saved logs/toy/preempted/checkpoints/last.ckpt" in output
    assert not list((project / "logs" / "toy" / "preempted" / "checkpoints").glob(".*.partial"))

    resumed = train(project, "preempted", MASTER_PORT=port)
    assert f"Resuming from logs/toy/preempted/checkpoints/last.ckpt (epoch 1, step {step})" in resumed
    assert "not resumable" not in resumed
    assert_same_parameters(last_checkpoint(project, "preempted"), reference)


def test_a_killed_worker_is_restarted_by_torchrun_and_resumes(project, reference):
    port = str(free_port())
    settings = {"RUN_ID": "elastic", "MASTER_PORT": port, "LAUNCHER": "torchrun"}
    process = launch(project, "cpu:2", 0, *run_args(project, "elastic"), **settings)
    wait_for_step(progress_file(project, "elastic"), STEPS_PER_EPOCH + 10)
    workers = [
        pid
        for pid in processes_in(project)
        if b"cli.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
        and b"torch.distributed.run" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        and b"elastic" in Path(f"/proc/{pid}/environ").read_bytes()
    ]
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGKILL)
    output = finish(process)

    assert "will restart worker group" in output
    assert output.count(f"Resuming from logs/toy/elastic/checkpoints/last.ckpt (epoch 0, step {STEPS_PER_EPOCH})") == 1
    assert "connectFullMesh" not in output
    assert_same_parameters(last_checkpoint(project, "elastic"), reference)


def test_rerunning_a_finished_run_trains_nothing_and_says_so(run_cli, caplog):
    args = ["fit", "-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.max_epochs=1", "--trainer.limit_train_batches=4"]
    finished = run_cli(*args).trainer.global_step
    caplog.clear()
    with caplog.at_level(logging.INFO):
        rerun = run_cli(*args)
    assert finished == rerun.trainer.global_step == 4
    output = caplog.text
    assert "Resuming from logs/toy/default/checkpoints/last.ckpt (epoch 0, step 4)" in output
    assert "Nothing to train: the run in logs/toy/default already reached its end" in output


SAVE_FOREVER = textwrap.dedent(
    """
    import sys, torch
    from training import AtomicCheckpointIO
    io = AtomicCheckpointIO()
    weights = torch.zeros(50_000_000)
    for step in range(1_000_000):
        weights.fill_(step)
        io.save_checkpoint({"step": step, "weights": weights}, sys.argv[1])
    """
)


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    target = tmp_path / "checkpoints" / "last.ckpt"
    partial = target.with_name(".last.ckpt.partial")
    writer = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, str(target)], cwd=Path(__file__).parents[1])
    try:
        deadline = time.monotonic() + 60
        while not (target.exists() and partial.exists() and partial.stat().st_size > 0):
            assert time.monotonic() < deadline, "the writer never started a second save"
            time.sleep(0.005)
    finally:
        writer.kill()
        writer.wait()
    checkpoint = torch.load(target, weights_only=True)
    assert checkpoint["step"] >= 0
    assert torch.equal(checkpoint["weights"], torch.full((50_000_000,), float(checkpoint["step"])))
