"""scripts/run_ddp_train.sh: several nodes, real hosts, torchrun, clean shutdown, and bad input."""

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster import (
    check_four_ranks,
    finish,
    launch,
    launcher_env,
    probe_args,
    processes_in,
    wait_for_step,
    written_files,
)
from tests.conftest import copy_project, free_port

pytestmark = pytest.mark.distributed

QUICK_RUN = ["--trainer.max_epochs=1", "--trainer.enable_progress_bar=false"]


def test_two_hosts_in_network_namespaces(tmp_path, two_hosts):
    master_host, worker_host = two_hosts
    nodes = [copy_project(tmp_path / f"node{rank}") for rank in range(2)]
    settings = {"MASTER_ADDR": master_host["address"], "MASTER_PORT": "29500", "NUM_NODES": "2"}
    # LOCAL_RANK and WORLD_SIZE left in the environment (as the seeds' scripts set them) must not leak in.
    settings |= {"LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    # A user's thread count wins over the default share of the cores (torch takes no more than there are).
    cores = len(os.sched_getaffinity(0))
    settings["OMP_NUM_THREADS"] = str(cores)
    extra = [*QUICK_RUN, *probe_args(tmp_path / "probe")]
    worker = launch(nodes[1], "cpu:2", 1, *extra, netns=worker_host["netns"], **settings)
    master = launch(nodes[0], "cpu:2", 0, *extra, netns=master_host["netns"], **settings)
    master_output, worker_output = finish(master), finish(worker)

    records = check_four_ranks(tmp_path / "probe")
    assert [r["threads"] for r in records] == [cores] * 4
    assert "NUM_NODES=2 from the environment overrides trainer.num_nodes" in master_output
    assert "All distributed processes registered. Starting with 4 processes" in master_output
    for output, host in ((master_output, master_host), (worker_output, worker_host)):
        assert f"GLOO_SOCKET_IFNAME={host['interface']}" in output
        assert f"NCCL_SOCKET_IFNAME={host['interface']}" in output
    assert any(p.startswith("logs/toy/default/checkpoints/") for p in written_files(nodes[0]))
    assert written_files(nodes[1]) == ["logs/nodes/node1.log"]
    node_log = (nodes[1] / "logs" / "nodes" / "node1.log").read_text()
    assert "Initializing distributed: GLOBAL_RANK: 3, MEMBER: 4/4" in node_log
    assert node_log.startswith("==== ") and worker_output.endswith(node_log), "the terminal did not show the log"


def test_rank_zero_must_run_on_the_master(tmp_path, two_hosts):
    master_host, worker_host = two_hosts
    node = copy_project(tmp_path / "node")
    settings = {"MASTER_ADDR": master_host["address"], "MASTER_PORT": "29500", "NUM_NODES": "2"}
    process = launch(node, "cpu:2", 0, netns=worker_host["netns"], **settings)
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0
    assert f"MASTER_ADDR={master_host['address']} is not an address of this machine" in output
    assert not (node / "logs").exists()


def test_torchrun_launcher_runs_the_same_job(tmp_path):
    nodes = [copy_project(tmp_path / f"node{rank}") for rank in range(2)]
    settings = {"MASTER_PORT": str(free_port()), "NUM_NODES": "2", "LAUNCHER": "torchrun"}
    extra = [*QUICK_RUN, *probe_args(tmp_path / "probe")]
    worker = launch(nodes[1], "cpu:2", 1, *extra, **settings)
    master = launch(nodes[0], "cpu:2", 0, *extra, **settings)
    master_output, _ = finish(master), finish(worker)

    check_four_ranks(tmp_path / "probe")
    assert "-m torch.distributed.run --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d" in master_output


def dry_run(node: Path, gpus: str, rank: str, *extra: str, **settings: str) -> str:
    done = subprocess.run(
        [str(node / "scripts" / "run_ddp_train.sh"), gpus, rank, *extra],
        env=launcher_env(DRY_RUN="1", **settings),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (node / "logs").exists(), "a dry run wrote logs"
    return done.stdout


def test_dry_run_prints_the_environment_and_command_for_gpus(tmp_path):
    node = copy_project(tmp_path / "node")
    out = dry_run(node, "2,3", "0", "--trainer.max_epochs=7", SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    assert "export CUDA_VISIBLE_DEVICES=2,3" in out
    assert "export NCCL_SOCKET_IFNAME=lo" in out and "export GLOO_SOCKET_IFNAME=lo" in out
    assert "export NCCL_IB_DISABLE=1" in out and "export NODE_RANK=0" in out
    assert "unset LOCAL_RANK RANK WORLD_SIZE" in out
    command = out.strip().splitlines()[-1]
    assert command.endswith(
        "cli.py fit -c configs/ddp.yaml --trainer.accelerator=gpu --trainer.devices=2 --trainer.max_epochs=7"
    )


def test_dry_run_keeps_an_explicit_nccl_interface_and_builds_the_torchrun_command(tmp_path):
    node = copy_project(tmp_path / "node")
    out = dry_run(node, "cpu:3", "0", NCCL_SOCKET_IFNAME="^docker", LAUNCHER="torchrun", MAX_RESTARTS="2")
    assert "export NCCL_SOCKET_IFNAME=\\^docker" in out and "export GLOO_SOCKET_IFNAME=lo" in out
    assert "export CUDA_VISIBLE_DEVICES=''" in out
    command = out.strip().splitlines()[-1]
    assert "-m torch.distributed.run --nnodes=1 --nproc-per-node=3 --rdzv-backend=c10d" in command
    assert "--rdzv-endpoint=127.0.0.1:29500" in command and "--max-restarts=2" in command
    assert command.endswith("cli.py fit -c configs/ddp.yaml --trainer.accelerator=cpu --trainer.devices=3")


def start_long_run(node: Path, **settings: str) -> subprocess.Popen:
    """A run that trains until stopped, returned once it has trained a few steps."""
    pace = ["--trainer.callbacks+=tests.probe.SlowDown", "--trainer.callbacks.seconds=0.001"]
    progress = node / "train.step"
    process = launch(
        node,
        "cpu:2",
        0,
        "--trainer.max_epochs=1000",
        "--trainer.enable_progress_bar=false",
        *pace,
        f"--trainer.callbacks.progress_file={progress}",
        **settings,
    )
    wait_for_step(progress, 5)
    return process


def assert_everything_stopped(node: Path, port: str) -> None:
    deadline = time.monotonic() + 15
    while processes_in(node) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_in(node) == [], "training processes were left running"
    with socket.socket() as listener:  # nobody listens on the port any more (as TCPStore, allow TIME_WAIT)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(port)))
        listener.listen()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_stops_every_process(tmp_path, signum):
    node = copy_project(tmp_path / "node")
    port = str(free_port())
    process = start_long_run(node, MASTER_PORT=port, STOP_TIMEOUT="20")
    training = processes_in(node)
    assert len(training) >= 2
    process.send_signal(signum)
    output, _ = process.communicate(timeout=180)
    assert f"stopping training: sending {signum.name} to" in output
    if signum == signal.SIGTERM:  # a preemption: checkpoint, then a clean exit
        assert process.returncode == 0, output
        assert "Stopped by a signal at epoch" in output
    else:  # Lightning's Ctrl-C handling, which stops the ranks it started
        assert process.returncode != 0
        assert "Detected KeyboardInterrupt, attempting graceful shutdown" in output
    assert "still running after" not in output, "training ignored the signal and was killed"
    assert_everything_stopped(node, port)


def test_a_killed_worker_process_stops_the_whole_node(tmp_path):
    node = copy_project(tmp_path / "node")
    port = str(free_port())
    process = start_long_run(node, MASTER_PORT=port)
    ranks = [pid for pid in processes_in(node) if b"cli.py" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    os.kill(max(ranks), signal.SIGKILL)  # the rank Lightning started last: local rank 1
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0
    assert "training exited with status" in output
    assert_everything_stopped(node, port)


def test_workers_orphaned_by_a_killed_torchrun_are_stopped(tmp_path):
    node = copy_project(tmp_path / "node")
    port = str(free_port())
    process = start_long_run(node, MASTER_PORT=port, LAUNCHER="torchrun", STOP_TIMEOUT="5")
    agent = [pid for pid in processes_in(node) if b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(agent) == 1
    os.kill(agent[0], signal.SIGKILL)  # torchrun's workers live in sessions of their own and outlive it
    output, _ = process.communicate(timeout=180)
    assert process.returncode != 0
    assert "training exited, stopping processes it left running: sending SIGTERM to" in output
    assert_everything_stopped(node, port)


def fails(node: Path, gpus: str, rank: str, *extra: str, timeout: float = 300, **settings: str) -> str:
    done = subprocess.run(
        [str(node / "scripts" / "run_ddp_train.sh"), gpus, rank, *extra],
        env=launcher_env(**settings),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    assert not (node / "logs").exists(), "something was launched"
    return done.stderr


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    return copy_project(tmp_path_factory.mktemp("node"))


@pytest.mark.parametrize("gpus", ["abc", "0,,1", "-1", "0;1", "cpu:0", "cpu:x", "gpu:2", ""])
def test_bad_gpu_list_is_rejected(node, gpus):
    err = fails(node, gpus, "0")
    assert f"GPUS={gpus} is neither a comma-separated list of GPU ids (e.g. 0,1) nor cpu:N" in err


def test_duplicate_gpu_ids_are_named(node):
    err = fails(node, "0,1,0,3,3", "0")
    assert "GPUS=0,1,0,3,3 lists GPU 0,3 more than once" in err


@pytest.mark.parametrize("rank", ["x", "-1", "1.5"])
def test_node_rank_must_be_an_integer(node, rank):
    assert f"NODE_RANK={rank} is not a non-negative integer" in fails(node, "cpu:1", rank)


def test_node_rank_must_be_below_num_nodes(node):
    err = fails(node, "cpu:1", "1")
    assert "NODE_RANK=1 is out of range: the config has trainer.num_nodes=1, so node ranks are 0..0" in err
    err = fails(node, "cpu:1", "2", NUM_NODES="2")
    assert "trainer.num_nodes=2, so node ranks are 0..1" in err


def write_settings(node: Path, text: str) -> str:
    path = node / "scripts" / "test-cluster.env"
    path.write_text(text)
    return str(path)


def test_missing_settings_are_named(node):
    settings = write_settings(node, "MASTER_ADDR=127.0.0.1\nCONFIGS=configs/ddp.yaml\n")
    err = fails(node, "cpu:1", "0", CLUSTER_ENV=settings)
    assert f"MASTER_PORT is not set. Set it in {settings}" in err
    err = fails(node, "cpu:1", "0", MASTER_ADDR="")
    assert "MASTER_ADDR is not set" in err


def test_malformed_settings_line_is_named(node):
    settings = write_settings(node, "MASTER_ADDR=127.0.0.1\nMASTER PORT 29500\n")
    err = fails(node, "cpu:1", "0", CLUSTER_ENV=settings)
    assert f"{settings}:2: expected KEY=value, got: MASTER PORT 29500" in err


def test_missing_settings_file_is_named(node):
    assert "settings file /nowhere/cluster.env not found" in fails(
        node, "cpu:1", "0", CLUSTER_ENV="/nowhere/cluster.env"
    )


def test_missing_config_file_is_named(node):
    err = fails(node, "cpu:1", "0", CONFIGS="configs/ddp.yaml configs/nope.yaml")
    assert "config file configs/nope.yaml (from CONFIGS in scripts/cluster.env) not found" in err


def test_config_error_stops_before_launch(node):
    err = fails(node, "cpu:1", "0", "--trainer.max_epochz=3")
    assert "trainer.max_epochz" in err and "Nothing was launched" in err


def test_busy_master_port_names_the_process(node):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        err = fails(node, "cpu:1", "0", MASTER_PORT=str(port))
    holder_name = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert f"MASTER_PORT {port} is already in use on the master, by {holder_name} (pid {os.getpid()})" in err


def test_unreachable_master_fails_after_the_timeout(node):
    started = time.monotonic()
    err = fails(node, "cpu:1", "1", NUM_NODES="2", MASTER_PORT=str(free_port()), CONNECT_TIMEOUT="3")
    assert time.monotonic() - started < 150  # CONNECT_TIMEOUT of scripts/cluster.env: 300
    assert re.search(r"node 1 cannot reach the master at 127\.0\.0\.1:\d+ after 3s", err)
    assert "open in the master's firewall" in err
