"""scripts/run_ddp_train.sh running real jobs: several nodes, real hosts, torchrun, clean shutdown. What it refuses
before launching anything is in tests/test_launcher_checks.py."""

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import (
    DDP_YAML,
    SINGLE_PROCESS,
    assert_everything_stopped,
    check_ranks,
    copy_project,
    finish,
    free_port,
    launch,
    probe_args,
    processes_in,
    wait_for_step,
    written_files,
)

pytestmark = pytest.mark.distributed

QUICK_RUN = ["--trainer.max_epochs=1"]


def test_two_hosts_in_network_namespaces(tmp_path, two_hosts):
    master_host, worker_host = two_hosts
    nodes = [copy_project(tmp_path / f"node{rank}") for rank in range(2)]
    settings = {"MASTER_ADDR": master_host["address"], "MASTER_PORT": "29500", "NUM_NODES": "2"}
    # LOCAL_RANK and WORLD_SIZE left in the environment (as hand-written launch scripts set them) must not leak in.
    settings |= {"LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    # A user's thread count wins over the default share of the cores (torch takes no more than there are).
    cores = len(os.sched_getaffinity(0))
    settings["OMP_NUM_THREADS"] = str(cores)
    extra = [*QUICK_RUN, *probe_args(tmp_path / "probe")]
    worker = launch(nodes[1], "cpu:2", 1, *extra, netns=worker_host["netns"], **settings)
    master = launch(nodes[0], "cpu:2", 0, *extra, netns=master_host["netns"], **settings)
    master_output, worker_output = finish(master), finish(worker)

    # Two threads per process: bit-identical weights need MKL's kernels picked before they run on both
    # (training/job/vector_math.py).
    records = check_ranks(tmp_path / "probe")
    assert [r["threads"] for r in records] == [cores] * 4
    assert "NUM_NODES=2 from the environment overrides trainer.num_nodes" in master_output
    assert "Process group started: gloo, 4 processes" in master_output
    for output, host in ((master_output, master_host), (worker_output, worker_host)):
        assert f"GLOO_SOCKET_IFNAME={host['interface']}" in output
        assert f"NCCL_SOCKET_IFNAME=={host['interface']}" in output
    assert any(p.startswith("logs/toy/default/checkpoints/") for p in written_files(nodes[0]))
    assert written_files(nodes[1]) == ["logs/nodes/node1.log"]
    node_log = (nodes[1] / "logs" / "nodes" / "node1.log").read_text()
    assert "[rank: 1] Seed set to 42" in node_log, "the second process of node 1 is missing from its log"
    assert node_log.startswith("==== ") and worker_output.endswith(node_log), "the terminal did not show the log"


def test_nodes_that_load_different_checkpoints_stop_naming_each_one(tmp_path, two_hosts, run_cli):
    # No shared storage: only node 0 holds the run's last.ckpt (made here by a short one-process run), so
    # `ckpt_path: last` resumes node 0 and starts node 1 from scratch.
    run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2")
    nodes = [copy_project(tmp_path / f"node{rank}") for rank in range(2)]
    checkpoints = Path("logs", "toy", "default", "checkpoints")
    (nodes[0] / checkpoints).mkdir(parents=True)
    (tmp_path / checkpoints / "last.ckpt").rename(nodes[0] / checkpoints / "last.ckpt")
    saved = (nodes[0] / checkpoints / "last.ckpt").read_bytes()
    settings = {"MASTER_ADDR": two_hosts[0]["address"], "MASTER_PORT": "29500", "NUM_NODES": "2"}
    worker = launch(nodes[1], "cpu:1", 1, *QUICK_RUN, netns=two_hosts[1]["netns"], **settings)
    master = launch(nodes[0], "cpu:1", 0, *QUICK_RUN, netns=two_hosts[0]["netns"], **settings)
    for node, process in enumerate((master, worker)):
        output, _ = process.communicate(timeout=600)
        assert process.returncode != 0, output
        assert "the job cannot start, its processes load different checkpoints: node 0 (" in output
        assert f"{nodes[0] / checkpoints / 'last.ckpt'} ({len(saved)} bytes), node 1 (" in output
        assert ") loads none. To fix: keep logs/ on storage every node shares" in output
        assert "Traceback" not in output, f"node {node}"
    assert (nodes[0] / checkpoints / "last.ckpt").read_bytes() == saved, "the run trained on and saved"


def test_torchrun_launcher_runs_the_same_job(tmp_path):
    # One process per node: the two-host test above runs two per node.
    nodes = [copy_project(tmp_path / f"node{rank}") for rank in range(2)]
    settings = {"MASTER_PORT": str(free_port()), "NUM_NODES": "2", "LAUNCHER": "torchrun"}
    extra = [*QUICK_RUN, *probe_args(tmp_path / "probe")]
    worker = launch(nodes[1], "cpu:1", 1, *extra, **settings)
    master = launch(nodes[0], "cpu:1", 0, *extra, **settings)
    master_output, _ = finish(master), finish(worker)

    check_ranks(tmp_path / "probe", nodes=2, per_node=1)
    assert (
        "-m torch.distributed.run --nnodes=2 --local-addr=127.0.0.1 --rdzv-conf=join_timeout=300,is_host=true "
        in master_output
    )
    assert "--nproc-per-node=1 --rdzv-backend=c10d" in master_output


def start_long_run(node: Path, gpus: str = "cpu:2", **settings: str) -> subprocess.Popen:
    """A run that trains until stopped, returned once it has trained a few steps."""
    pace = ["--trainer.callbacks+=tests.helpers.probe.SlowDown", "--trainer.callbacks.seconds=0.001"]
    progress = node / "train.step"
    process = launch(
        node,
        gpus,
        0,
        "--trainer.max_epochs=1000",
        *pace,
        f"--trainer.callbacks.progress_file={progress}",
        **settings,
    )
    wait_for_step(progress, 5)
    return process


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
    process = start_long_run(node, "cpu:1", MASTER_PORT=port, LAUNCHER="torchrun", STOP_TIMEOUT="5")
    agent = [pid for pid in processes_in(node) if b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(agent) == 1
    os.kill(agent[0], signal.SIGKILL)  # torchrun's workers live in sessions of their own and outlive it
    output, _ = process.communicate(timeout=180)
    assert process.returncode != 0
    assert "training exited, stopping processes it left running: sending SIGTERM to" in output
    assert_everything_stopped(node, port)


def test_a_run_past_its_end_stops_before_any_training_process_starts(tmp_path, run_cli):
    node = copy_project(tmp_path / "node")
    run = node / "logs" / "toy" / "default"
    fit = ["fit", "-c", DDP_YAML, *SINGLE_PROCESS, f"--trainer.logger.init_args.save_dir={node / 'logs'}"]
    run_cli(*fit, "--trainer.max_epochs=2", "--trainer.limit_train_batches=2")
    record = {path.name: path.read_bytes() for path in run.iterdir() if path.is_file()}

    process = launch(node, "cpu:2", 0, "--trainer.max_epochs=1", MASTER_PORT=str(free_port()))
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 2, output
    assert f"error: the run in {run} is past the end this config sets: its checkpoint {run}/checkpoints/last.ckpt" in (
        output
    )
    assert "Process group started" not in output and "Traceback" not in output
    assert {path.name: path.read_bytes() for path in run.iterdir() if path.is_file()} == record
