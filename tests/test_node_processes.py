"""A process of a one-node job (``python cli.py fit``, 2 CPU processes) that dies or is told to stop: the others stop
at once, and the node's output ends with one paragraph that names it and says that the same command goes on.

Each run is stopped at its own moment: rank 0 or rank 1 killed while its job starts, rank 0 or rank 1 killed in
training (held at a step), SIGTERM while rank 0 waits for a second node that the job's num_nodes asks for and nobody
started.
"""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import wait_for_hold
from tests.helpers.one_node import last_paragraph, local_ranks, start, wait_gone

pytestmark = pytest.mark.distributed

PEER_TIMEOUT = 60  # seconds, the config's
HOLD_STEP = 3


def rank_one(workdir: Path, rank_zero: subprocess.Popen) -> int:
    """The pid of the process rank 0 started, once it runs."""
    return local_ranks(workdir, rank_zero, 2)[1]


@pytest.fixture(scope="module")
def killed_while_starting(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("starting")
    zero = start(workdir)
    one = rank_one(workdir, zero)
    zero.kill()  # while rank 1 is still importing: it never reached the store rank 0 held
    zero.wait()
    seconds = wait_gone(one, 240)
    return {"zero": zero.pid, "seconds": seconds, "output": (workdir / "output").read_text()}


def test_rank_0_killed_while_the_job_starts_stops_rank_1_at_once_saying_why(killed_while_starting):
    assert killed_while_starting["seconds"] < 240, "rank 1 waited for the join timeout"
    paragraph = last_paragraph(killed_while_starting["output"])
    assert paragraph.startswith(
        f"error: the job cannot start: rank 0 (local rank 0, pid {killed_while_starting['zero']}) of node 0 ("
    )
    assert "which started this process, ended" in paragraph
    assert paragraph.endswith("Nothing was trained: run the same command again (on every node) to start the job.")


@pytest.fixture(scope="module")
def rank_1_killed_while_starting(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("starting1")
    zero = start(workdir)
    one = rank_one(workdir, zero)
    os.kill(one, signal.SIGKILL)  # while it imports: rank 0 waits for it to join
    zero.wait(timeout=240)
    return {"one": one, "status": zero.returncode, "output": (workdir / "output").read_text()}


def test_rank_1_killed_while_the_job_starts_is_named_by_rank_0_at_once(rank_1_killed_while_starting):
    assert rank_1_killed_while_starting["status"] == 1
    paragraph = last_paragraph(rank_1_killed_while_starting["output"])
    assert paragraph.startswith(
        f"error: the job cannot start: rank 1 (local rank 1, pid {rank_1_killed_while_starting['one']}) of node 0 ("
    )
    assert ") was killed by SIGKILL (by someone, or by the system when memory ran out" in paragraph


def killed_in_training(workdir: Path, victim: int) -> dict:
    hold = workdir / "hold"
    args = ["--trainer.max_epochs=1", "--data.init_args.num_train=1024", "--trainer.logger=false"]
    args += ["--trainer.callbacks+=tests.helpers.probe.HoldAtStep", f"--trainer.callbacks.step={HOLD_STEP}"]
    zero = start(workdir, *args, f"--trainer.callbacks.hold_file={hold}")
    hold.touch()
    one = rank_one(workdir, zero)
    wait_for_hold(hold, 2, zero)
    pids = [zero.pid, one]
    os.kill(pids[victim], signal.SIGKILL)
    hold.unlink()
    seconds = wait_gone(pids[1 - victim], PEER_TIMEOUT)
    zero.wait()
    return {"pids": pids, "seconds": seconds, "status": zero.returncode, "output": (workdir / "output").read_text()}


@pytest.fixture(scope="module")
def rank_1_killed(tmp_path_factory):
    return killed_in_training(tmp_path_factory.mktemp("rank1"), victim=1)


@pytest.fixture(scope="module")
def rank_0_killed(tmp_path_factory):
    return killed_in_training(tmp_path_factory.mktemp("rank0"), victim=0)


def test_rank_1_killed_in_training_is_named_by_rank_0_with_the_command_that_resumes(rank_1_killed):
    assert rank_1_killed["status"] == 1, "not rank 0's own exit"
    assert "Forcefully terminating" not in rank_1_killed["output"]
    paragraph = last_paragraph(rank_1_killed["output"])
    assert paragraph.startswith(
        f"error: the job stopped: rank 1 (local rank 1, pid {rank_1_killed['pids'][1]}) of node 0 ("
    )
    assert ") was killed by SIGKILL (by someone, or by the system when memory ran out" in paragraph
    assert f"This node had reached epoch 0, step {HOLD_STEP}." in paragraph
    assert "To resume from it, run the same command on every node again" in paragraph
    assert rank_1_killed["output"].count("error: ") == 1


def test_rank_0_killed_in_training_is_named_by_rank_1_with_the_command_that_resumes(rank_0_killed):
    assert "sendBytes failed" not in rank_0_killed["output"]
    paragraph = last_paragraph(rank_0_killed["output"])
    assert paragraph.startswith(
        f"error: the job stopped: rank 0 (local rank 0, pid {rank_0_killed['pids'][0]}) of node 0 ("
    )
    assert "which started this process, ended" in paragraph
    assert f"This node had reached epoch 0, step {HOLD_STEP}." in paragraph
    assert "To resume from it, run the same command on every node again" in paragraph
    assert rank_0_killed["output"].count("error: ") == 1


@pytest.fixture(scope="module")
def terminated_while_waiting(tmp_path_factory):
    """SIGTERM to rank 0 once it says it waits for node 1, which the job's num_nodes=2 asks for."""
    workdir = tmp_path_factory.mktemp("terminated")
    zero = start(workdir, "--trainer.num_nodes=2")
    one = rank_one(workdir, zero)
    output = workdir / "output"
    while "node rank 1 not yet" not in output.read_text():
        assert zero.poll() is None, output.read_text()
        time.sleep(0.05)
    zero.send_signal(signal.SIGTERM)
    zero.wait(timeout=120)
    wait_gone(one, 60)
    return {"status": zero.returncode, "output": output.read_text()}


def test_the_join_progress_line_says_which_num_nodes_the_job_waits_for(terminated_while_waiting):
    assert (
        "node rank 1 not yet (the job has num_nodes=2: for fewer nodes, set trainer.num_nodes or NUM_NODES)"
        in terminated_while_waiting["output"]
    )


def test_sigterm_while_the_job_starts_stops_it_with_a_paragraph(terminated_while_waiting):
    assert terminated_while_waiting["status"] == 1
    paragraph = last_paragraph(terminated_while_waiting["output"])
    assert paragraph.startswith("error: node 0 (")
    assert paragraph.endswith(
        ") was stopped by a signal (SIGTERM) before training started: nothing was trained and no checkpoint was "
        "written. Run the same command again (on every node) to start the job."
    )


def catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_sigterm_while_cli_imports_torch_and_lightning_stops_it_with_a_paragraph(tmp_path):
    """cli.py takes SIGTERM from its first lines, before the seconds of its imports: sent as soon as it does."""
    zero = start(tmp_path)
    while not catches_sigterm(zero.pid):
        assert zero.poll() is None, (tmp_path / "output").read_text()
        time.sleep(0.01)
    zero.send_signal(signal.SIGTERM)
    assert zero.wait(timeout=120) == 1
    output = (tmp_path / "output").read_text()
    assert "Traceback" not in output, output
    assert last_paragraph(output) == (
        f"error: cli.py on {socket.gethostname()} was stopped by a signal (SIGTERM) while it started, before "
        "training: nothing was trained and no checkpoint was written. Run the same command again to start the job."
    )
    assert not (tmp_path / "logs").exists()
