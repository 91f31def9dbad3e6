"""The run's directory failing under a running job (2 CPU processes): deleted while it trains, or on a disk that fills
up while TensorBoard writes there. One paragraph on every node, exit 1, no traceback."""

import re
import shutil

import pytest
import torch

from tests.helpers import copy_project, fill, free_port, launch, tmpfs, wait_for_hold
from tests.helpers.one_node import ended, held_at, last_paragraph, start, traces

pytestmark = pytest.mark.distributed

STEPS_PER_EPOCH = 64
HOLD_STEP = 30  # the next logged steps (every 20) come before the epoch's end, where a save would write again


@pytest.fixture(scope="module")
def deleted(tmp_path_factory):
    """The run's directory deleted while the ranks hold at HOLD_STEP of a first attempt."""
    workdir = tmp_path_factory.mktemp("deleted")
    hold = workdir / "hold"
    hold.touch()
    job = start(workdir, "--trainer.max_epochs=1", *held_at(hold, HOLD_STEP))
    wait_for_hold(hold, 2, job)
    run = workdir / "logs" / "toy" / "default"
    shutil.rmtree(run)
    hold.unlink()
    return ended(workdir, job) | {"workdir": workdir, "run": run}


@pytest.fixture(scope="module")
def started_anew(deleted):
    return ended(deleted["workdir"], start(deleted["workdir"], "--trainer.max_epochs=1"), within=600)


def test_a_run_directory_deleted_while_the_job_trains_stops_it_with_one_paragraph_naming_it(deleted):
    assert deleted["status"] == 1, deleted["output"]
    assert not traces(deleted["output"]), deleted["output"]
    paragraph = last_paragraph(deleted["output"])
    assert paragraph.startswith(
        f"error: the run's directory {deleted['run']} was deleted while the job trained: TensorBoard could not write "
        "there (FileNotFoundError: No such file or directory: "
    ), paragraph
    assert "Its checkpoints went with it, so nothing is left to resume from. This node had reached epoch 0, step " in (
        paragraph
    )
    assert "Running the same command on every node again starts the run anew, from the first step" in paragraph
    assert deleted["output"].count("error: ") == 1
    assert deleted["left"] == [], "processes of the job left running"


def test_the_same_command_then_says_it_trains_from_the_first_step(deleted, started_anew):
    assert started_anew["status"] == 0, started_anew["output"]
    checkpoints = deleted["run"] / "checkpoints"
    assert (
        f"Training from the first step: no checkpoint was loaded, {checkpoints} holds no last.ckpt."
        in started_anew["output"]
    )
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == STEPS_PER_EPOCH


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    """A 2 MB file system of its own (tmpfs) for the run's directory."""
    with tmpfs(tmp_path_factory.mktemp("disks") / "small", "2m") as disk:
        yield disk


def test_a_disk_that_fills_while_tensorboard_writes_stops_both_nodes_each_naming_it(tmp_path, small_disk):
    # The job as two nodes of one process each: global rank 0, which writes the logs, on node 0.
    nodes = [copy_project(tmp_path / f"node{rank}") for rank in range(2)]
    hold = tmp_path / "hold"
    hold.touch()
    job = ["--trainer.max_epochs=1", f"--trainer.logger.init_args.save_dir={small_disk}", *held_at(hold, HOLD_STEP)]
    # A record every step: the event file soon needs a page of the disk more, well before the epoch's end.
    job.append("--trainer.log_every_n_steps=1")
    settings = {"MASTER_PORT": str(free_port()), "NUM_NODES": "2"}
    logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    worker, master = (launch(nodes[rank], "cpu:1", rank, *job, log=logs[rank], **settings) for rank in (1, 0))
    wait_for_hold(hold, 2, master)
    fill(small_disk)
    hold.unlink()
    assert master.wait(600) == worker.wait(600) == 1
    master_log, worker_log = (log.read_text() for log in logs)
    run = small_disk / "toy" / "default"
    (paragraph,) = [line for line in master_log.splitlines() if line.startswith("error: ")]
    assert paragraph.startswith(
        f"error: the disk of the run's directory {run} is full: TensorBoard could not write there (OSError: No space "
        "left on device"
    ), paragraph
    assert "Free space on it (or give the logger's save_dir another disk), then resume." in paragraph
    (told,) = [line for line in worker_log.splitlines() if line.startswith("error: ")]
    head, _, _ = paragraph.partition("; this node was started with: ")
    assert told.startswith(head), told
    for output in master_log, worker_log:
        assert not traces(output), output


def test_with_one_process_a_deleted_run_directory_ends_in_the_same_paragraph(tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    job = start(tmp_path, "--trainer.max_epochs=1", *held_at(hold, HOLD_STEP), devices=1)
    wait_for_hold(hold, 1, job)
    run = tmp_path / "logs" / "toy" / "default"
    shutil.rmtree(run)
    hold.unlink()
    result = ended(tmp_path, job)
    assert result["status"] == 1, result["output"]
    paragraph = last_paragraph(result["output"])
    assert paragraph.startswith(f"error: the run's directory {run} was deleted while the job trained: TensorBoard ")
    assert re.search(r"This run had reached epoch 0, step \d+\.", paragraph) and result["output"].count("error: ") == 1
    assert not traces(result["output"]) and result["left"] == []
