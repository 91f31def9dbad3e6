"""Who speaks for a node whose processes stop: local rank 0 while it runs, then the lowest local rank still running,
which ends the later ones before it ends, so each node says why it stopped exactly once, however many processes it
has (training/job/node_processes.py).

The first tests play a node's processes with plain ones that carry the environment Lightning gives them; the others
run real jobs of 3 CPU processes (one shared run per case) and kill some of them.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, wait_for_hold
from tests.helpers.one_node import gone, last_paragraph, local_ranks, start, traces, wait_gone
from training.job import node_processes

PEER_TIMEOUT = 60  # seconds, the config's
HOLD_STEP = 2
# Waits on stdin, so that the test ends it by closing the pipe; a DataLoader worker names itself as torch does.
WAITS = "import sys; sys.stdin.read()"
WORKER = "import pathlib, sys; pathlib.Path('/proc/self/comm').write_text('pt_data_worker'); sys.stdin.read()"


@pytest.mark.parametrize(("slurm_localid", "speaks"), [("0", True), ("1", False)])
def test_srun_tasks_of_a_node_speak_once_by_their_slurm_local_id(monkeypatch, slurm_localid, speaks):
    # srun starts each process of a node itself: each is its own starter, and only SLURM_LOCALID tells them apart.
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SLURM_LOCALID", slurm_localid)
    node_processes.mark_as_starter()
    assert node_processes.speaks_for_node() is speaks


@pytest.fixture
def orphans(monkeypatch):
    """Local ranks 1, 3 and a DataLoader worker of rank 3, whose starter has ended; this process plays local rank 2."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    starter = ended.stdout.strip()
    monkeypatch.setenv(node_processes.STARTED_BY, starter)
    monkeypatch.setenv("LOCAL_RANK", "2")
    started = {}
    for rank, code in (("1", WAITS), ("3", WAITS), ("3", WORKER)):
        env = {**os.environ, node_processes.STARTED_BY: starter, "LOCAL_RANK": rank}
        process = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE)
        started[rank if code == WAITS else "worker"] = process
    while Path(f"/proc/{started['worker'].pid}/comm").read_text().strip() != "pt_data_worker":
        assert started["worker"].poll() is None
        time.sleep(0.01)
    yield started
    for process in started.values():
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    ("subcommand", "told"),
    [
        ("fit", "before training: nothing was trained and no checkpoint was written. Run the same command again to "
         "start the job."),
        ("predict", "before its predict ran: nothing was written. Run the same command again to start the predict."),
    ],
)  # fmt: skip
def test_a_stop_while_cli_py_starts_speaks_of_what_its_subcommand_would_have_written(subcommand, told):
    # The handler cli.py takes first (training/job/early.py), in a process of the standard library alone; the signal
    # arrives inside a library's bare except (an optional import), which would swallow a SystemExit.
    stop = (
        "import signal, sys\n"
        "from training.job import early\n"
        "sys.argv[1:] = sys.argv[2:]\n"
        "early.take_stop_signals()\n"
        "try:\n"
        "    signal.raise_signal(signal.SIGINT)\n"
        "except BaseException:\n"
        "    pass\n"
        "print('went on')\n"
    )
    stopped = subprocess.run(
        [sys.executable, "-c", stop, "cli.py", subcommand], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert stopped.returncode == 1 and stopped.stdout == "", stopped
    assert stopped.stderr.strip().endswith(f"was stopped by a signal (SIGINT) while it started, {told}"), stopped


def test_once_local_rank_0_ended_the_lowest_local_rank_still_running_speaks_for_the_node(orphans):
    one, three = orphans["1"], orphans["3"]
    assert node_processes.starter_gone()
    assert not node_processes.speaks_for_node(), "local rank 1 speaks"
    one.kill()
    while not gone(one.pid):  # a zombie, not yet waited for, has ended too
        time.sleep(0.01)
    assert node_processes.speaks_for_node()
    assert node_processes.running() == {3: three.pid}, "the worker is no local rank"
    node_processes.end_later()
    assert three.wait() == -signal.SIGKILL


def killed_in_training(workdir: Path, victims: list[int]) -> dict:
    """A job of 3 processes held at step HOLD_STEP, where the processes of local ranks ``victims`` are killed."""
    hold = workdir / "hold"
    args = ["--trainer.max_epochs=1", "--data.init_args.num_train=1024", "--trainer.logger=false"]
    args += ["--trainer.callbacks+=tests.helpers.probe.HoldAtStep", f"--trainer.callbacks.step={HOLD_STEP}"]
    zero = start(workdir, *args, f"--trainer.callbacks.hold_file={hold}", devices=3)
    hold.touch()
    pids = local_ranks(workdir, zero, 3)
    wait_for_hold(hold, 3, zero)
    for victim in victims:
        os.kill(pids[victim], signal.SIGKILL)
    hold.unlink()
    seconds = max(wait_gone(pid, PEER_TIMEOUT) for pid in pids)
    zero.wait()
    return {"pids": pids, "seconds": seconds, "output": (workdir / "output").read_text()}


@pytest.mark.distributed
def test_local_ranks_0_and_1_killed_together_are_named_once_by_local_rank_2(tmp_path):
    stopped = killed_in_training(tmp_path, [0, 1])
    paragraph = last_paragraph(stopped["output"])
    assert stopped["output"].count("error: ") == 1, stopped["output"]
    assert paragraph.startswith(f"error: the job stopped: rank 0 (local rank 0, pid {stopped['pids'][0]}) of node 0 (")
    assert "which started this process, ended" in paragraph
    assert f"This node had reached epoch 0, step {HOLD_STEP}." in paragraph
    assert not traces(stopped["output"])


# Each a job of its own: 2 nodes of 1 process, started by hand on this machine. The trace showed at every kill before.
KILLS = 2
QUICK_PEER_TIMEOUT = "0:00:05"  # node 1 names the lost store this long after its collective failed


def global_rank_0_killed(workdir: Path) -> str:
    """The output of node 1 of a 2-node job whose global rank 0 is killed in training."""
    workdir.mkdir()
    hold = workdir / "hold"
    hold.touch()
    args = ["--trainer.num_nodes=2", "--trainer.max_epochs=1", "--data.init_args.num_train=1024"]
    args += ["--trainer.logger=false", f"--trainer.strategy.init_args.peer_timeout={QUICK_PEER_TIMEOUT}"]
    args += ["--trainer.callbacks+=tests.helpers.probe.HoldAtStep", f"--trainer.callbacks.step={HOLD_STEP}"]
    args += [f"--trainer.callbacks.hold_file={hold}"]
    port = str(free_port())
    nodes = [start(workdir / f"node{rank}", *args, devices=1, MASTER_PORT=port, NODE_RANK=str(rank)) for rank in (0, 1)]
    wait_for_hold(hold, 2, nodes[0])
    nodes[0].kill()
    hold.unlink()
    for node in nodes:
        node.wait(timeout=PEER_TIMEOUT)
    return (workdir / "node1" / "output").read_text()


@pytest.mark.distributed
def test_global_rank_0_killed_leaves_no_torch_trace_on_the_other_node(tmp_path):
    for kill in range(KILLS):
        other = global_rank_0_killed(tmp_path / str(kill))
        assert not traces(other), other
        paragraph = last_paragraph(other)
        assert other.count("error: ") == 1, other
        assert paragraph.startswith("error: the job lost node 0"), other  # its host, once node 1 has heard it
