"""scripts/run_ddp_train.sh stops before launching anything: every kind of bad input, a rank 0 started on the
wrong host, and the dry run. No training process starts here; tests/test_launcher.py runs real jobs."""

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import copy_project, free_port, launch, launcher_env


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    return copy_project(tmp_path_factory.mktemp("node"))


# The cases that get as far as parsing the config, which imports Lightning: a few seconds each.
PARSING = {
    "dry run, GPUs": (
        ("2,3", "0", "--trainer.max_epochs=7"),
        {"DRY_RUN": "1", "SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"},
    ),
    "dry run, torchrun": (
        ("cpu:3", "0"),
        {"DRY_RUN": "1", "NCCL_SOCKET_IFNAME": "^docker", "LAUNCHER": "torchrun", "MAX_RESTARTS": "2"},
    ),
    "rank 1 of 1 node": (("cpu:1", "1"), {}),
    "config error": (("cpu:1", "0", "--trainer.max_epochz=3"), {}),
    "run id that is a path": (("cpu:1", "0"), {"RUN_ID": "../../elsewhere"}),
    "GPUs this node lacks": (("0,1", "0"), {}),
    "unreachable master": (("cpu:1", "1"), {"NUM_NODES": "2", "MASTER_PORT": str(free_port()), "CONNECT_TIMEOUT": "3"}),
}


@pytest.fixture(scope="module")
def parsed(node):
    """Every case of PARSING, started together so their imports share the cores: (status, stdout, stderr, seconds)."""
    started = time.monotonic()
    processes = {
        case: subprocess.Popen(
            [str(node / "scripts" / "run_ddp_train.sh"), *args],
            env=launcher_env(**settings),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for case, (args, settings) in PARSING.items()
    }
    results = {}
    for case, process in processes.items():
        out, err = process.communicate(timeout=600)
        results[case] = (process.returncode, out, err, time.monotonic() - started)
    assert not (node / "logs").exists(), "something was launched or logged"
    return results


def succeeded(parsed: dict, case: str) -> str:
    status, out, err, _ = parsed[case]
    assert status == 0, out + err
    return out


def failed(parsed: dict, case: str) -> str:
    status, out, err, _ = parsed[case]
    assert status != 0, out + err
    return err


def test_dry_run_prints_the_environment_and_command_for_gpus(parsed):
    out = succeeded(parsed, "dry run, GPUs")
    assert "export CUDA_VISIBLE_DEVICES=2,3" in out
    assert "export NCCL_SOCKET_IFNAME=lo" in out and "export GLOO_SOCKET_IFNAME=lo" in out
    assert "export NCCL_IB_DISABLE=1" in out and "export NODE_RANK=0" in out
    assert "unset LOCAL_RANK RANK WORLD_SIZE" in out
    command = out.strip().splitlines()[-1]
    assert command.endswith(
        "cli.py fit -c configs/ddp.yaml --trainer.accelerator=gpu --trainer.devices=2 --trainer.max_epochs=7"
    )


def test_dry_run_keeps_an_explicit_nccl_interface_and_builds_the_torchrun_command(parsed):
    out = succeeded(parsed, "dry run, torchrun")
    assert "export NCCL_SOCKET_IFNAME=\\^docker" in out and "export GLOO_SOCKET_IFNAME=lo" in out
    assert "export CUDA_VISIBLE_DEVICES=''" in out
    command = out.strip().splitlines()[-1]
    assert "-m torch.distributed.run --nnodes=1 --nproc-per-node=3 --rdzv-backend=c10d" in command
    assert "--rdzv-endpoint=127.0.0.1:29500" in command and "--max-restarts=2" in command
    assert command.endswith("cli.py fit -c configs/ddp.yaml --trainer.accelerator=cpu --trainer.devices=3")


def test_node_rank_must_be_below_num_nodes(parsed):
    err = failed(parsed, "rank 1 of 1 node")
    assert "NODE_RANK=1 is out of range: the config has trainer.num_nodes=1, so node ranks are 0..0" in err


def test_node_rank_must_be_below_num_nodes_from_the_environment_before_the_config_is_parsed(node):
    err = fails(node, "cpu:1", "2", NUM_NODES="2")
    assert "NODE_RANK=2 is out of range: NUM_NODES=2, so node ranks are 0..1" in err


def test_config_error_stops_before_launch(parsed):
    err = failed(parsed, "config error")
    assert "trainer.max_epochz" in err and "Nothing was launched" in err


def test_a_run_id_that_is_a_path_stops_before_launch(parsed, node):
    err = failed(parsed, "run id that is a path")
    assert "RUN_ID='../../elsewhere' is not a run name: use letters, digits" in err and "Nothing was launched" in err
    assert not (node.parent.parent / "elsewhere").exists()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this node has the GPUs the case asks for")
def test_gpu_ids_the_node_lacks_stop_before_launch_naming_what_it_has(parsed):
    err = failed(parsed, "GPUs this node lacks")
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert line.startswith(
        f"error: the GPU list names 2 GPU(s) (CUDA_VISIBLE_DEVICES=0,1), but torch sees {torch.cuda.device_count()} "
        f"on this node: torch {torch.__version__} has "
    )
    assert "Train on CPU with cpu:N, install a CUDA build of torch" in line and line.endswith("Nothing was launched.")
    assert "Traceback" not in err


def test_unreachable_master_fails_after_the_timeout(parsed):
    err = failed(parsed, "unreachable master")
    assert parsed["unreachable master"][3] < 150  # CONNECT_TIMEOUT of scripts/cluster.env: 300
    assert re.search(r"node 1 cannot reach the master at 127\.0\.0\.1:\d+ after 3s", err)
    assert "open in the master's firewall" in err


def test_rank_zero_must_run_on_the_master(node, two_hosts):
    master_host, worker_host = two_hosts
    settings = {"MASTER_ADDR": master_host["address"], "MASTER_PORT": "29500", "NUM_NODES": "2"}
    process = launch(node, "cpu:2", 0, netns=worker_host["netns"], **settings)
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0
    assert f"MASTER_ADDR={master_host['address']} is not an address of this machine" in output
    assert not (node / "logs").exists()


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


def test_busy_master_port_names_the_process(node):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        err = fails(node, "cpu:1", "0", MASTER_PORT=str(port))
    holder_name = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert f"MASTER_PORT {port} is already in use on the master, by {holder_name} (pid {os.getpid()})" in err
