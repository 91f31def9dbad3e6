"""scripts/launch_cluster.sh on two hosts (network namespaces, each running an OpenSSH server), launched from host 0:
one command trains on both, the hosts are checked before anything starts, a failed node or a killed launcher
stops every node, and a process of another job with the same command line is left alone. What it refuses
without connecting to any host is in tests/test_cluster_launch_checks.py."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import lightning
import pytest
import torch

from tests.helpers import check_ranks, copy_project, finish, launcher_env, probe_args, processes_in, wait_for_hold
from tests.helpers.hosts import network_namespaces, ssh_servers

pytestmark = pytest.mark.distributed

# Long enough for a graceful stop (a checkpoint) on a busy machine, which the launcher's own test checks.
STOP_TIMEOUT = 60
# What a stop may take beyond STOP_TIMEOUT: the launcher's own margin (30 s, scripts/cluster_nodes.sh) and the
# processes' exits on a busy machine.
MARGIN = 60


@dataclass
class Cluster:
    project: Path
    hosts: list[dict]
    hostfile: Path
    ssh_config: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The project on a file system both hosts share, as on NFS, and a hostfile naming them."""
    directory = tmp_path_factory.mktemp("cluster")
    project = copy_project(directory / "project")
    with network_namespaces(f"{os.getpid() % 100000}s") as hosts, ssh_servers(hosts, directory) as ssh_config:
        hostfile = directory / "hosts"
        master, worker = (host["address"] for host in hosts)
        hostfile.write_text(f"# the test's hosts\n{master}\n\nroot@{worker}  # a worker\n")
        yield Cluster(project, hosts, hostfile, ssh_config)


def launch_cluster(cluster: Cluster, hostfile: Path, gpus: str, *args: str, **settings: str) -> subprocess.Popen:
    """scripts/launch_cluster.sh started on host 0."""
    script = cluster.project / "scripts" / "launch_cluster.sh"
    env = launcher_env(SSH_OPTS=f"-F {cluster.ssh_config}", STOP_TIMEOUT=str(STOP_TIMEOUT), **settings)
    return subprocess.Popen(
        ["ip", "netns", "exec", cluster.hosts[0]["netns"], str(script), str(hostfile), gpus, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def trained(cluster):
    """A one-epoch run, 2 processes on each host: its output and where tests.helpers.probe.RankProbe wrote."""
    probe = cluster.project.parent / "probe"
    process = launch_cluster(cluster, cluster.hostfile, "cpu:2", "--trainer.max_epochs=1", *probe_args(probe))
    return finish(process), probe


def node_log(cluster: Cluster, rank: int, log_dir: str = "logs/nodes") -> str:
    return (cluster.project / log_dir / f"node{rank}.log").read_text()


def printed_by(output: str, rank: int, host: dict) -> str:
    """The lines of the launcher's output that node ``rank`` printed, without their prefix."""
    prefix = f"[node {rank} {host['address']}] "
    return "\n".join(line.removeprefix(prefix) for line in output.splitlines() if line.startswith(prefix))


def test_one_command_trains_on_every_host_as_one_job(cluster, trained):
    output, probe = trained
    check_ranks(probe, nodes=2, per_node=2)
    assert "[node 0 10.231.0.1] Process group started: gloo, 4 processes" in output
    assert (cluster.project / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt").exists()
    assert output.rstrip().endswith("every node finished")


def test_each_host_is_checked_and_runs_its_node_with_the_master_of_the_first_line(cluster, trained):
    output, _ = trained
    assert f"every host is ready: torch {torch.__version__}, Lightning {lightning.__version__}" in output
    for rank, host in enumerate(cluster.hosts):
        log = node_log(cluster, rank)
        assert f"node {rank} of 2, 2 process(es) (cpu:2)" in log
        assert f"GLOO_SOCKET_IFNAME={host['interface']}" in log, "the node ran on another host"
        assert "MASTER_ADDR=10.231.0.1" in log
        assert "NUM_NODES=2 from the environment overrides trainer.num_nodes" in printed_by(output, rank, host)


def test_every_line_is_prefixed_with_its_node_and_kept_in_the_node_log(cluster, trained):
    output, _ = trained
    for rank, host in enumerate(cluster.hosts):
        prefix = f"[node {rank} {host['address']}] "
        shown = [line.removeprefix(prefix) for line in output.splitlines() if line.startswith(prefix)]
        logged = node_log(cluster, rank).splitlines()
        assert shown[-len(logged) :] == logged, f"node {rank}'s log is not what the terminal showed"
    launcher_lines = [line for line in output.splitlines() if not line.startswith("[node ")]
    assert len(launcher_lines) < 10, launcher_lines


def training_processes(project: Path, node_rank: int) -> list[int]:
    """The cli.py processes of ``node_rank`` training in ``project``."""
    found = []
    for pid in processes_in(project):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"\0cli.py\0" in command and f"NODE_RANK={node_rank}".encode() in environment:
            found.append(pid)
    return found


def held_run(hold: Path) -> list[str]:
    """Arguments of a run that trains until stopped, its ranks holding at step 2 while ``hold`` exists."""
    hold.touch()
    return [
        "--trainer.max_epochs=1000",
        "--trainer.callbacks+=tests.helpers.probe.HoldAtStep",
        "--trainer.callbacks.step=2",
        f"--trainer.callbacks.hold_file={hold}",
    ]


def start_decoy(host: dict, directory: Path, pid: int) -> subprocess.Popen:
    """A process on ``host`` with the command line of process ``pid``, of another job in another directory: what a
    clean-up by name (pkill -f) would kill too."""
    command = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    (directory / "cli.py").write_text("import signal\n\nsignal.pause()\n")
    decoy = subprocess.Popen(["ip", "netns", "exec", host["netns"], *command], cwd=directory)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{decoy.pid}/cmdline").read_bytes() != Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the decoy did not start"
        time.sleep(0.05)
    return decoy


def assert_nothing_left(project: Path, deadline: float) -> None:
    """By ``deadline``, no process runs in ``project`` on either host, the launcher's ssh clients included."""
    while processes_in(project) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in processes_in(project)}
    assert not left, f"still running {STOP_TIMEOUT}s + {MARGIN}s after the stop: {left}"


def test_a_failed_node_stops_the_other_and_spares_a_job_with_the_same_command_line(cluster, tmp_path):
    hold = tmp_path / "hold"
    settings = {"RUN_ID": "failed", "LOG_DIR": "logs/failed"}
    process = launch_cluster(cluster, cluster.hostfile, "cpu:1", *held_run(hold), **settings)
    wait_for_hold(hold, 2, process)
    (worker,) = training_processes(cluster.project, 1)
    decoy = start_decoy(cluster.hosts[1], tmp_path, worker)
    os.kill(worker, signal.SIGKILL)
    stopped = time.monotonic()
    output, _ = process.communicate(timeout=STOP_TIMEOUT + MARGIN)
    assert process.returncode == 137, output
    assert "node 1 (10.231.0.2) failed with status 137: stopping the other nodes with SIGTERM" in output
    assert "node 0: terminated, stopping training: sending SIGTERM to" in printed_by(output, 0, cluster.hosts[0])
    assert "error: node 1 (10.231.0.2) failed first, with status 137: see its lines above" in output
    assert output.rstrip().endswith(f"{cluster.project}/logs/failed/node1.log on 10.231.0.2.")
    assert_nothing_left(cluster.project, stopped + STOP_TIMEOUT + MARGIN)
    assert decoy.poll() is None, "the other job's process was stopped"


def test_a_killed_launcher_stops_every_node_and_spares_a_job_with_the_same_command_line(cluster, tmp_path):
    hold = tmp_path / "hold"
    settings = {"RUN_ID": "orphaned", "LOG_DIR": "logs/orphaned"}
    process = launch_cluster(cluster, cluster.hostfile, "cpu:1", *held_run(hold), **settings)
    wait_for_hold(hold, 2, process)
    (worker,) = training_processes(cluster.project, 1)
    decoy = start_decoy(cluster.hosts[1], tmp_path, worker)
    process.kill()
    stopped = time.monotonic()
    assert_nothing_left(cluster.project, stopped + STOP_TIMEOUT + MARGIN)
    output, _ = process.communicate(timeout=60)  # what the nodes printed after the launcher was gone
    for rank, host in enumerate(cluster.hosts):
        assert f"node {rank}: terminated, stopping training: sending SIGTERM" in printed_by(output, rank, host)
    assert "still running after" not in output, "training ignored the stop and was killed"
    stopped = "Stopped by a signal (SIGTERM) at epoch "
    assert stopped in printed_by(output, 0, cluster.hosts[0]), "no checkpoint was saved"
    assert decoy.poll() is None, "the other job's process was stopped"


def test_hosts_that_are_not_ready_are_named_before_anything_starts(cluster, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.231.0.1\nroot@10.231.0.2\n10.231.0.3\n")  # nothing answers at 10.231.0.3
    older = tmp_path / "older" / "lightning-2.0.0.dist-info"  # what pip leaves of an installed Lightning 2.0.0
    older.mkdir(parents=True)
    (older / "METADATA").write_text("Metadata-Version: 2.1\nName: lightning\nVersion: 2.0.0\n")
    python = tmp_path / "python"  # the Python of host 1 finds an older Lightning
    python.write_text(
        f'#!/bin/sh\ncase "$SSH_CONNECTION" in *" 10.231.0.2 22") export PYTHONPATH={older.parent} ;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    settings = {"PYTHON": str(python), "MASTER_ADDR": "localhost", "LOG_DIR": "logs/refused"}
    process = launch_cluster(cluster, hostfile, "cpu:1", **settings)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 2, output
    assert "error: MASTER_ADDR=localhost is 127.0.0.1 on the master, 10.231.0.1: a loopback address" in output
    assert (
        f"error: 10.231.0.2 (node 1) has torch {torch.__version__} and Lightning 2.0.0, node 0 (10.231.0.1) torch "
        f"{torch.__version__} and Lightning {lightning.__version__}. Install the same versions on every host" in output
    )
    (unreachable,) = [
        line for line in output.splitlines() if line.startswith("error: cannot reach 10.231.0.3 (node 2)")
    ]
    assert "logs in without a password or a question" in unreachable, "not one paragraph"
    assert output.rstrip().endswith("Nothing was started.")
    assert not (cluster.project / "logs" / "refused").exists()


def test_a_host_without_the_project_is_named(cluster):
    process = launch_cluster(cluster, cluster.hostfile, "cpu:1", PROJECT_DIR="/nowhere/project")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 2, output
    for rank, host in enumerate(cluster.hosts):
        assert f"error: {host['address']} (node {rank}) has no copy of this project in /nowhere/project. " in output


def test_a_node_that_refuses_to_start_stops_the_launch_with_its_words(cluster, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("root@10.231.0.2\n")
    process = launch_cluster(cluster, hostfile, "cpu:1", LAUNCHER="mpirun", LOG_DIR="logs/refused")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 2, output
    assert "error: LAUNCHER=mpirun: use lightning (the default) or torchrun." in printed_by(output, 0, cluster.hosts[1])
    assert "node 0 (10.231.0.2) failed with status 2\n" in output
    assert (
        "error: node 0 (10.231.0.2) failed first, with status 2: see its lines above ([node 0 10.231.0.2] ...)"
        in output
    )


def test_an_elastic_job_goes_on_when_a_node_fails_and_takes_it_back_when_the_launch_starts_it_again(cluster, tmp_path):
    """Node 1's torchrun and its worker killed at step 2: node 0 goes on (alone, holding at step 3, if node 1 is not
    back by its restart), the launch starts node 1 again, and the job, back on both nodes, finishes."""
    kill, alone = tmp_path / "kill.hold", tmp_path / "alone.hold"
    alone.touch()
    settings = {"RUN_ID": "elastic", "LOG_DIR": "logs/elastic", "LAUNCHER": "torchrun", "MIN_NODES": "1"}
    args = [*held_run(kill), "--trainer.callbacks.world_size=2", "--trainer.max_epochs=2"]
    args += ["--trainer.callbacks+=tests.helpers.probe.HoldAtStep", "--trainer.callbacks.step=3"]
    args += [f"--trainer.callbacks.hold_file={alone}", "--trainer.callbacks.world_size=1"]
    args.append("--trainer.strategy.init_args.peer_timeout=0:00:10")
    process = launch_cluster(cluster, cluster.hostfile, "cpu:1", *args, ELASTIC_WAIT="5", **settings)
    wait_for_hold(kill, 2, process)
    node1 = f"--local-addr={cluster.hosts[1]['address']}".encode()
    (agent,) = [pid for pid in processes_in(cluster.project) if node1 in Path(f"/proc/{pid}/cmdline").read_bytes()]
    workers = [pid for pid in processes_in(cluster.project) if parent(pid) == agent]
    for pid in [agent, *workers]:  # node 1 as a crash leaves it: nothing of its training left
        os.kill(pid, signal.SIGKILL)
    kill.unlink()
    output, _ = process.communicate(timeout=900)
    assert process.returncode == 0, output
    assert "node 1 (10.231.0.2) failed with status 137: the elastic job goes on without it (MIN_NODES=1)" in output
    assert "starting node 1 (10.231.0.2) again" in output
    node0 = printed_by(output, 0, cluster.hosts[0])
    assert "error: the job lost node 1" in node0
    # Node 1 back before node 0's restart gathered: [2, 2]; after it: [2, 1, 2] (node 0 waits at step 3 alone). On a
    # busy machine node 1 may first arrive after ELASTIC_WAIT: node 0 starts alone and the job re-forms on both.
    sizes = [int(line.rsplit("=", 1)[1]) for line in node0.splitlines() if "group_world_size=" in line]
    rounds = sizes[1:] if sizes[:2] == [1, 2] else sizes
    assert rounds in ([2, 2], [2, 1, 2]), f"the rounds of node 0's torchrun: {sizes}"
    assert "node 1 (10.231.0.2) finished" in output
    assert output.rstrip().endswith("every node finished"), output
    checkpoint = torch.load(
        cluster.project / "logs" / "toy" / "elastic" / "checkpoints" / "last.ckpt", weights_only=True
    )
    assert checkpoint["epoch"] == 1
    alone.unlink()


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0
