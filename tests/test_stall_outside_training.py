"""A rank that stops making progress outside the training loop, while the other waits for it: in a fit's validation,
where a DataLoader worker of rank 1 hangs on a read (a dataset on a dead mount), and in predict, where rank 1's main
thread does. Each is named in the log with where it hangs, the job stops after stall_timeout with one paragraph that
names the user's frame, and the same command runs again once the storage is back. Plain Lightning waits out the
collective timeout (30 minutes here) and then names only the collective."""

import re
from pathlib import Path

import pytest
import torch

from tests.helpers import copy_project, free_port, launch, processes_in
from tests.helpers.one_node import job_processes, last_paragraph, start

pytestmark = pytest.mark.distributed

STALLING = [
    "--data=tests.zoo.HeldOutSamples",
    "--data.init_args.stall_rank=1",
    "--data.init_args.stall_at=20",  # of a worker's reads, over every epoch: in epoch 1's validation
    "--trainer.num_sanity_val_steps=0",
    "--trainer.max_epochs=2",
    "--trainer.strategy.init_args.stall_report=0:00:04",
    "--trainer.strategy.init_args.stall_timeout=0:00:08",
]
# Where zoo.Reads hangs: its own frame, below which the wait's frames are threading's.
IN_READS = r"__getitem__ \(.*/tests/zoo\.py:\d+\)"


def run(workdir: Path, *args: str, subcommand: str = "fit") -> dict:
    """What a job of 2 CPU processes left once its first process ended."""
    job = start(workdir, *args, subcommand=subcommand)
    job.wait(timeout=300)
    return {"status": job.returncode, "output": (workdir / "output").read_text(), "left": job_processes(workdir)}


@pytest.fixture(scope="module")
def stalled(tmp_path_factory) -> dict:
    """A fit stalled in validation, the same fit once the storage is back, then a predict stalled in the main thread
    (no DataLoader workers) and again once the storage is back."""
    workdir = tmp_path_factory.mktemp("stalled")
    stall = workdir / "stall"
    found = {}
    for name, subcommand, extra in [
        ("validation", "fit", []),
        ("prediction", "predict", ["--data.init_args.num_workers=0"]),
    ]:
        stall.touch()
        found[name] = run(workdir, *STALLING, f"--data.init_args.stall_file={stall}", *extra, subcommand=subcommand)
        found[name]["stalled_pid"] = int(Path(f"{stall}.rank1").read_text())
        found[name]["checkpoint"] = torch.load(workdir / "logs/toy/default/checkpoints/last.ckpt", weights_only=True)
        found[name]["predict_records"] = sorted((workdir / "logs").rglob("predict*"))
        stall.unlink()  # the storage is back
        Path(f"{stall}.rank1").unlink()
        found[name]["again"] = run(
            workdir, *STALLING, f"--data.init_args.stall_file={stall}", *extra, subcommand=subcommand
        )
    found["workdir"] = workdir
    return found


def test_a_rank_whose_dataloader_worker_hangs_in_validation_is_named_with_the_workers_pid_and_frame(stalled):
    result = stalled["validation"]
    output = result["output"]
    assert result["status"] == 1, output
    assert result["left"] == [], "processes of the job left running"
    (report,) = [line for line in output.splitlines() if line.startswith("warning: rank 1 (local rank 1, pid")]
    assert re.search(r"has made no progress in validation for \d+ s \(at epoch 1, step 32\), while the other", report)
    worker = stalled["validation"]["stalled_pid"]
    assert report.endswith(f"Its main thread waits for its DataLoader worker (pid {worker}), which is at:"), report
    assert re.search(r'File ".*/tests/zoo\.py", line \d+, in __getitem__', output.split(report)[1]), output
    paragraph = last_paragraph(output)
    assert output.count("error: ") == 1, output
    assert re.search(
        r"^error: the job stopped: rank 1 \(local rank 1, pid \d+\) of node 0 \(.*\) made no progress in validation "
        r"for \d+ s \(at epoch 1, step 32\), longer than stall_timeout \(0:00:08\), while the other processes waited "
        rf"for it in a collective\. Its DataLoader worker \(pid {worker}\) was in {IN_READS}; every node's log",
        paragraph,
    ), paragraph
    assert "The last complete checkpoint is " in paragraph and "/last.ckpt (epoch 0, step 16)." in paragraph
    assert "To resume from it, run the same command again; this node was started with: " in paragraph
    assert result["checkpoint"]["global_step"] == 16, "the last checkpoint is epoch 0's"


def test_the_same_fit_resumes_from_the_last_checkpoint_once_the_storage_is_back(stalled):
    again = stalled["validation"]["again"]
    assert again["status"] == 0, again["output"]
    assert re.search(r"Resuming from .*/last\.ckpt \(epoch 0, step 16\)\.", again["output"]), again["output"]
    assert stalled["prediction"]["checkpoint"]["global_step"] == 32, "the resumed fit did not train to its end"


def test_a_rank_that_hangs_reading_in_predict_is_named_with_its_own_frame_not_threadings(stalled):
    result = stalled["prediction"]
    output = result["output"]
    assert result["status"] == 1, output
    assert result["left"] == []
    (report,) = [line for line in output.splitlines() if line.startswith("warning: rank 1 (local rank 1, pid")]
    assert re.search(r"has made no progress in prediction for \d+ s \(after 1 batch of predict\)", report), report
    paragraph = last_paragraph(output)
    assert re.search(rf" made no progress in prediction .* Its main thread was in {IN_READS}; every", paragraph)
    assert "threading" not in paragraph, paragraph
    assert (
        "The predict stopped before its end, so nothing it writes at its end was written: to predict from the start, "
        "run the same command again; this node was started with: " in paragraph
    ), paragraph
    assert result["predict_records"] == [], "a stopped predict wrote predictions or their record"


def test_the_same_predict_runs_to_its_end_once_the_storage_is_back(stalled):
    again = stalled["prediction"]["again"]
    assert again["status"] == 0, again["output"]
    (predictions,) = (stalled["workdir"] / "logs").rglob("predictions.pt")
    assert len(torch.load(predictions, weights_only=True)) == 64  # every held-out sample, once


def test_a_collective_timeout_names_the_rank_stalled_in_validation_on_both_nodes_and_it_blames_nobody(tmp_path):
    # Two nodes of one process on loopback, as two machines; stall_timeout 0, so the collective timeout (10 s) ends
    # the wait: global rank 0's collective fails and names rank 1 (node 1), which takes that paragraph as its own
    # rather than name node 0 as lost once its store is gone. The main thread reads: the 20th read is in epoch 0.
    project = copy_project(tmp_path / "project")
    stall = project / "stall"
    stall.touch()
    args = [*STALLING, f"--data.init_args.stall_file={stall}", "--data.init_args.num_workers=0"]
    args += ["--trainer.strategy.init_args.timeout=0:00:10", "--trainer.strategy.init_args.stall_timeout=0:00:00"]
    settings = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NUM_NODES": "2"}
    launchers = [launch(project, "cpu:1", rank, *args, **settings) for rank in (0, 1)]
    try:
        outputs = [launcher.communicate(timeout=300)[0] for launcher in launchers]
    finally:
        stall.unlink()
    assert [launcher.returncode for launcher in launchers] == [1, 1], outputs
    for node in (0, 1):
        log = (project / "logs" / "nodes" / f"node{node}.log").read_text()
        paragraphs = [line for line in log.splitlines() if line.startswith("error: ")]
        assert len(paragraphs) == 1 and "the job lost" not in log, log
        assert re.search(
            r"^error: the job stopped: rank 1 \(local rank 0, pid \d+\) of node 1 \(.*\) made no progress in "
            r"validation for \d+ s \(at epoch 0, step 16\), longer than the collective timeout \(0:00:10\), while "
            rf"the other processes waited for it in a collective\. Its main thread was in {IN_READS}; every",
            paragraphs[0],
        ), paragraphs[0]
        assert "if such waits are expected, raise trainer.strategy.init_args.timeout" in paragraphs[0]
        assert "run the same command on every node again (only the node rank differs)" in paragraphs[0]
    assert processes_in(project) == []
