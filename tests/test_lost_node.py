"""A node lost in the middle of training, on real jobs of two nodes (one process each) started by the launcher.

Two runs, each shared by the tests after it:
- on two network-namespace hosts: one process holds in the first checkpoint save for twice peer_timeout and is
  not taken for lost; then the link of host 1 is cut, with the config's 30-minute collective timeout: both nodes
  stop within peer_timeout, each naming the other, and once the link is back the same commands resume and finish;
- over loopback: node 1's training process is killed, and node 0 names it as soon as its collective fails.
"""

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_everything_stopped, copy_project, free_port, launch, processes_in, wait_for_hold
from tests.helpers.hosts import set_link

pytestmark = pytest.mark.distributed

NUM_TRAIN = 1024
STEPS_PER_EPOCH = 8  # 1024 samples / (64 per batch * 2 processes)
EPOCHS = 2  # the link is cut in epoch 1: the resumed run trains what is left of the run, one epoch
PEER_TIMEOUT = 10  # seconds, a setting of these runs; the collective timeout stays at the config's 30 minutes
# How long after peer_timeout a node may take to stop and its launcher to exit, on a busy machine.
MARGIN = 60
CHECKPOINT = Path("logs", "toy", "default", "checkpoints", "last.ckpt")


def job_args(hold_at: int, hold_file: Path, peer_timeout: int = PEER_TIMEOUT) -> list[str]:
    return [
        f"--trainer.max_epochs={EPOCHS}",
        f"--data.init_args.num_train={NUM_TRAIN}",
        f"--trainer.strategy.init_args.peer_timeout=0:00:{peer_timeout:02d}",
        "--trainer.callbacks+=tests.helpers.probe.HoldAtStep",
        f"--trainer.callbacks.step={hold_at}",
        f"--trainer.callbacks.hold_file={hold_file}",
    ]


def wait_all(processes: list[subprocess.Popen], since: float) -> list[tuple[str, int, float]]:
    """Each process's output, status and the seconds from ``since`` until it ended (hang guard: 15 minutes)."""

    def wait(process: subprocess.Popen) -> tuple[str, int, float]:
        output, _ = process.communicate(timeout=900)
        return output, process.returncode, time.monotonic() - since

    with ThreadPoolExecutor(len(processes)) as pool:
        return list(pool.map(wait, processes))


@pytest.fixture(scope="module")
def cut_link(tmp_path_factory, two_hosts_for_module):
    root = tmp_path_factory.mktemp("cut")
    # One project directory for both hosts: storage every node shares at the same path (an NFS home), which
    # resuming needs.
    project = copy_project(root / "project")
    settings = {"MASTER_ADDR": two_hosts_for_module[0]["address"], "MASTER_PORT": "29500", "NUM_NODES": "2"}
    save_hold, step_hold = root / "save.hold", root / "step.hold"
    save_hold.touch()
    step_hold.touch()
    args = [
        "--trainer.callbacks+=tests.helpers.probe.HoldInSave",
        "--trainer.callbacks.rank=1",
        f"--trainer.callbacks.hold_file={save_hold}",
        *job_args(STEPS_PER_EPOCH + 1, step_hold),  # one step after the first checkpoint
    ]

    def start() -> list[subprocess.Popen]:
        worker = launch(project, "cpu:1", 1, *args, netns=two_hosts_for_module[1]["netns"], **settings)
        return [launch(project, "cpu:1", 0, *args, netns=two_hosts_for_module[0]["netns"], **settings), worker]

    launchers = start()
    held = Path(f"{save_hold}.held")
    deadline = time.monotonic() + 600
    while not held.exists():
        assert all(launcher.poll() is None for launcher in launchers), "the run ended before its first save"
        assert time.monotonic() < deadline, "rank 1 never saved"
        time.sleep(0.05)
    time.sleep(2 * PEER_TIMEOUT)  # rank 1 stays in its first save for twice peer_timeout
    alive_after_slow_save = [launcher.poll() is None for launcher in launchers]
    save_hold.unlink()

    wait_for_hold(step_hold, 2, launchers[0])
    set_link(two_hosts_for_module[1], "down")
    cut_at = time.monotonic()
    step_hold.unlink()  # on into the next gradient all-reduce, which cannot complete
    stopped = wait_all(launchers, cut_at)
    left = torch.load(project / CHECKPOINT, weights_only=True)

    set_link(two_hosts_for_module[1], "up")
    resumed = wait_all(start(), time.monotonic())
    return {"project": project, "alive": alive_after_slow_save, "stopped": stopped, "left": left, "resumed": resumed}


def test_a_save_longer_than_peer_timeout_is_no_lost_node(cut_link):
    assert cut_link["alive"] == [True, True]
    # The run went on past the save to the step where the link was cut.
    for output, _, _ in cut_link["stopped"]:
        assert f"This node had reached epoch 1, step {STEPS_PER_EPOCH + 1}." in output


def test_a_cut_link_stops_both_nodes_within_peer_timeout(cut_link):
    for node, (output, status, seconds) in enumerate(cut_link["stopped"]):
        assert status != 0, output
        assert seconds < PEER_TIMEOUT + MARGIN, f"node {node} stopped {seconds:.0f} s after the cut:\n{output}"


def test_each_node_names_the_other_in_one_paragraph(cut_link):
    project = cut_link["project"]
    (zero, _, _), (one, _, _) = cut_link["stopped"]
    assert re.search(r"error: the job lost node 1 \([^,]+, 10\.231\.0\.2\), last heard from at ", zero), zero
    store = "the job's store at 10.231.0.1:29500"
    assert re.search(r"error: the job lost node 0 \([^,]+, 10\.231\.0\.1\): " + re.escape(store), one), one
    for rank, output in enumerate((zero, one)):
        assert output.count("error: ") == 1 and "Traceback" not in output, output
        assert "peer_timeout (0:00:10)" in output or "a collective with it failed" in output
        assert f"This node had reached epoch 1, step {STEPS_PER_EPOCH + 1}." in output
        saved = f"The last complete checkpoint is {project / CHECKPOINT} (epoch 0, step {STEPS_PER_EPOCH})."
        assert saved in output
        assert f"once node {1 - rank} is back (or replaced), run the same command on every node again" in output
        command = f"MASTER_ADDR=10.231.0.1 MASTER_PORT=29500 NUM_NODES=2 PYTHON={sys.executable} "
        command += f"{project}/scripts/run_ddp_train.sh cpu:1 {rank} "
        command += "--trainer.callbacks+=tests.helpers.probe.HoldInSave "
        assert f"this node was started with: {command}" in output


def test_the_checkpoint_left_behind_loads(cut_link):
    assert cut_link["left"]["global_step"] == STEPS_PER_EPOCH


def test_the_same_commands_resume_once_the_link_is_back_and_finish(cut_link):
    project = cut_link["project"]
    for output, status, _ in cut_link["resumed"]:
        assert status == 0, output
    zero = cut_link["resumed"][0][0]
    assert f"Resuming from {project / CHECKPOINT} (epoch 0, step {STEPS_PER_EPOCH})." in zero
    assert torch.load(project / CHECKPOINT, weights_only=True)["global_step"] == EPOCHS * STEPS_PER_EPOCH


SLOW_PEER_TIMEOUT = 15  # longer than the wait after a failed collective (10 s), so that wait shows


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    root = tmp_path_factory.mktemp("killed")
    nodes = [copy_project(root / f"node{rank}") for rank in range(2)]
    port = str(free_port())
    hold = root / "hold"
    hold.touch()
    args = job_args(5, hold, SLOW_PEER_TIMEOUT)
    worker = launch(nodes[1], "cpu:1", 1, *args, MASTER_PORT=port, NUM_NODES="2")
    launchers = [launch(nodes[0], "cpu:1", 0, *args, MASTER_PORT=port, NUM_NODES="2"), worker]
    wait_for_hold(hold, 2, launchers[0])
    training = [pid for pid in processes_in(nodes[1]) if b"cli.py" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    for pid in training:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    hold.unlink()
    stopped = wait_all(launchers, killed_at)
    return {"nodes": nodes, "port": port, "stopped": stopped, "killed": training}


def test_a_killed_host_is_named_once_its_collective_fails(killed):
    assert len(killed["killed"]) == 1
    (zero, status, seconds), (_, one_status, _) = killed["stopped"]
    assert status != 0 and one_status != 0
    assert re.search(r"error: the job lost node 1 \([^,]+, 127\.0\.0\.1\), last heard from at ", zero), zero
    # Named by the collective that failed, before peer_timeout would have.
    assert "and a collective with it failed (RuntimeError: " in zero, zero
    assert "This node had reached epoch 0, step 5. No checkpoint was completed since this attempt started" in zero
    assert zero.count("error: ") == 1 and "Traceback" not in zero
    assert seconds < SLOW_PEER_TIMEOUT + MARGIN
    assert_everything_stopped(killed["nodes"][0], killed["port"])
