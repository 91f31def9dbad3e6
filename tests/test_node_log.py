"""The disk of a node's log (scripts/run_ddp_train.sh appends to logs/nodes/node<N>.log) full: at the start, the
launcher refuses to launch, naming it; while training runs, it says so once and training goes on to its end."""

import pytest
import torch

from tests.helpers import copy_project, fill, free_port, launch, tmpfs, wait_for_hold
from tests.helpers.one_node import held_at

pytestmark = pytest.mark.distributed


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB file system of its own (tmpfs) for the node's log."""
    with tmpfs(tmp_path / "small", "1m") as disk:
        yield disk


def test_a_full_disk_for_the_node_log_at_the_start_launches_nothing_and_says_why(tmp_path, small_disk):
    fill(small_disk)
    node = copy_project(tmp_path / "node")
    launcher = launch(node, "cpu:2", 0, LOG_DIR=str(small_disk), MASTER_PORT=str(free_port()))
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 2, output
    assert output.rstrip().splitlines()[-1] == (
        f"error: node 0 cannot write its log {small_disk}/node0.log (No space left on device). Free space on that "
        "disk, or set LOG_DIR (scripts/cluster.env or the environment) to a directory on another. Nothing was launched."
    ), output
    assert not (node / "logs" / "toy").exists()


def test_a_node_log_whose_disk_fills_while_training_runs_is_named_once_and_training_goes_on(tmp_path, small_disk):
    node = copy_project(tmp_path / "node")
    hold = tmp_path / "hold"
    hold.touch()
    output = tmp_path / "launcher.out"  # what the terminal shows
    run = ["--trainer.max_epochs=1", *held_at(hold, 10)]
    launcher = launch(node, "cpu:2", 0, *run, log=output, LOG_DIR=str(small_disk), MASTER_PORT=str(free_port()))
    wait_for_hold(hold, 2, launcher)
    fill(small_disk)
    hold.unlink()
    assert launcher.wait(600) == 0, output.read_text()
    shown = output.read_text()
    warnings = [line for line in shown.splitlines() if "cannot write its log" in line]
    assert warnings == [
        f"warning: node 0 cannot write its log {small_disk}/node0.log any more (No space left on device): training "
        "goes on, its output from here on shows only here. Free space on that disk, or set LOG_DIR to another for the "
        "next run."
    ], shown
    assert "tee:" not in shown
    last = torch.load(node / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 64  # the whole epoch: 8192 samples, 64 per batch, 2 processes
