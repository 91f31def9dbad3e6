"""scripts/run_ddp_train.sh stops before launching anything: every kind of bad input, a rank 0 started on the
wrong host, and the dry run; and the mistakes that only the config shows stop the training process before it
trains. tests/test_launcher.py runs real jobs."""

import os
import shlex
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from scripts import gpu_check
from tests.helpers import REPO, copy_project, free_port, launch, launcher_env


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    return copy_project(tmp_path_factory.mktemp("node"))


GPU_UUIDS = ["GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", "GPU-5c7a2e10-4b1d-9f3e-0a6b-7d8e9f0a1b2c"]
MIG_IDS = ["MIG-c7384736-a75d-5afc-978f-d2f1294409fd", "MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0"]
# Empty means unset to the launcher: what the test machine's environment sets must not leak into a case.
NOT_SET = {"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_ORDER": ""}

# The launcher's cases that run to their end: those that import torch or Lightning take a few seconds each. What the
# launcher makes of GPUS and the settings is checked in bash alone (validated below); the dry runs show that it is
# what the launcher exports and runs (torchrun's parses the config). Those of IN_TRAINING start the training process,
# which parses the config itself.
PARSING = {
    "dry run, GPUs": (
        ("2,3", "0", "--trainer.max_epochs=7"),
        {"DRY_RUN": "1", "SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", **NOT_SET},
    ),
    # One torchrun case (its parse imports Lightning): a worker of an elastic job, with settings of its own.
    "dry run, torchrun": (
        ("cpu:3", "1"),
        {"DRY_RUN": "1", "NCCL_SOCKET_IFNAME": "^docker", "LAUNCHER": "torchrun", "MAX_RESTARTS": "2"}
        | {"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
        | {"MIN_NODES": "2", "NUM_NODES": "3", "ELASTIC_WAIT": "45"},
    ),
    "GPUs this node lacks": (("0,1", "0"), {"CUDA_VISIBLE_DEVICES": ""}),
}
IN_TRAINING = {
    "rank 1 of 1 node": (("cpu:1", "1"), {}),
    "config error": (("cpu:1", "0", "--trainer.max_epochz=3"), {}),
    "run id that is a path": (("cpu:1", "0"), {"RUN_ID": "../../elsewhere"}),
    "unreachable master": (("cpu:1", "1"), {"NUM_NODES": "2", "MASTER_PORT": str(free_port()), "CONNECT_TIMEOUT": "3"}),
}


def run_together(project: Path, cases: dict) -> dict[str, tuple[int, str, str, float]]:
    """Every case of ``cases`` in ``project``, started together so that their imports share the cores: (status,
    stdout, stderr, seconds it ran)."""
    started = time.monotonic()
    processes = {
        case: subprocess.Popen(
            [str(project / "scripts" / "run_ddp_train.sh"), *args],
            env=launcher_env(**settings),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for case, (args, settings) in cases.items()
    }

    def finish(process: subprocess.Popen) -> tuple[int, str, str, float]:
        out, err = process.communicate(timeout=600)
        return process.returncode, out, err, time.monotonic() - started

    with ThreadPoolExecutor(len(processes)) as pool:
        return dict(zip(processes, pool.map(finish, processes.values()), strict=True))


@pytest.fixture(scope="module")
def parsed(node):
    """Every case of PARSING: the launcher parses the config, and launches nothing."""
    results = run_together(node, PARSING)
    assert not (node / "logs").exists(), "something was launched or logged"
    return results


@pytest.fixture(scope="module")
def in_training(tmp_path_factory):
    """Every case of IN_TRAINING, in a copy of the project of their own: the training process refuses the case before
    it trains (the distributed tier: each starts a training process)."""
    trained = copy_project(tmp_path_factory.mktemp("trained"))
    results = run_together(trained, IN_TRAINING)
    assert [path.name for path in (trained / "logs").iterdir()] == ["nodes"], "a run directory was made"
    return results


def succeeded(parsed: dict, case: str) -> str:
    status, out, err, _ = parsed[case]
    assert status == 0, out + err
    return out


def failed(parsed: dict, case: str) -> str:
    status, out, err, _ = parsed[case]
    assert status != 0, out + err
    return err


def stopped_in_training(in_training: dict, case: str) -> str:
    """The paragraph of a case of IN_TRAINING, whose training process refused it before training."""
    status, out, err, _ = in_training[case]
    rank = IN_TRAINING[case][0][1]
    assert status != 0, out + err
    assert err.rstrip().endswith(f"training exited with status {status}; its output is in logs/nodes/node{rank}.log")
    assert "Traceback" not in out, out
    [paragraph] = [line for line in out.splitlines() if line.startswith("error: ")]
    return paragraph


def exported(out: str) -> dict[str, str]:
    """The variables a dry run exports, as the shell reads them."""
    return dict(shlex.split(line)[1].split("=", 1) for line in out.splitlines() if line.startswith("export "))


# The launcher's steps up to the config's parse, then what they would export and the cli.py arguments, last.
UP_TO_THE_PARSE = """set -euo pipefail
source scripts/common.sh
validate_node "$@"
export_node_environment
apply_exports
printf 'export %s\\n' "${exports[@]}"
echo "cli.py ${cli_args[*]}"
"""


def validated(node: Path, gpus: str, rank: str, **settings: str) -> tuple[dict[str, str], str]:
    """What scripts/common.sh's validate_node makes of GPUS, NODE_RANK and the settings, without parsing the
    config: the environment training would get, and everything printed, the cli.py arguments last."""
    done = subprocess.run(
        ["bash", "-c", UP_TO_THE_PARSE, "validate_node", gpus, rank],
        cwd=node,
        env=launcher_env(**settings),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return exported(done.stdout), done.stdout


def test_dry_run_prints_the_environment_and_command_for_gpus(parsed):
    out = succeeded(parsed, "dry run, GPUs")
    env = exported(out)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["NCCL_IB_DISABLE"] == "1" and env["NODE_RANK"] == "0"
    assert "unset LOCAL_RANK RANK WORLD_SIZE" in out
    command = out.strip().splitlines()[-1]
    assert command.endswith(
        "cli.py fit -c configs/ddp.yaml --trainer.accelerator=gpu --trainer.devices=2 --trainer.max_epochs=7"
    )


def test_nccl_gets_exactly_the_interface_the_launcher_picks_and_gloo_its_name(parsed, node):
    # From SOCKET_IFNAME, and from the route to MASTER_ADDR (127.0.0.1: lo). A plain lo would be a prefix to NCCL.
    from_route, _ = validated(node, ",".join(GPU_UUIDS), "0", **NOT_SET)
    for env in (exported(succeeded(parsed, "dry run, GPUs")), from_route):
        assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("=lo", "lo")


def test_cuda_counts_gpus_as_nvidia_smi_does_unless_told_otherwise(parsed):
    assert exported(succeeded(parsed, "dry run, GPUs"))["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert exported(succeeded(parsed, "dry run, torchrun"))["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


def test_gpus_pick_by_position_from_the_gpus_a_scheduler_gave(node):
    env, out = validated(node, "0,1", "0", CUDA_VISIBLE_DEVICES="2,3")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "GPUS=0,1 picks from CUDA_VISIBLE_DEVICES=2,3, set before the launcher started" in out
    assert "training uses 2,3" in out
    env, out = validated(node, "1", "0", CUDA_VISIBLE_DEVICES="2,3")
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert out.strip().splitlines()[-1].endswith("--trainer.accelerator=gpu --trainer.devices=1")


def test_gpu_uuids_and_mig_devices_are_gpu_ids(node):
    for ids in (GPU_UUIDS, MIG_IDS):
        env, out = validated(node, ",".join(ids), "0", **NOT_SET)
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(ids)
        assert out.strip().splitlines()[-1].endswith("--trainer.accelerator=gpu --trainer.devices=2"), ids


def test_dry_run_keeps_an_explicit_nccl_interface_and_builds_the_torchrun_command(parsed):
    out = succeeded(parsed, "dry run, torchrun")
    env = exported(out)
    assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("^docker", "lo")
    assert env["CUDA_VISIBLE_DEVICES"] == "", "cpu:N must hide every GPU, the scheduler's too"
    command = out.strip().splitlines()[-1]
    assert "--nproc-per-node=3 --rdzv-backend=c10d" in command
    assert "--rdzv-endpoint=127.0.0.1:29500" in command and "--max-restarts=2" in command
    trains = "cli.py fit -c configs/ddp.yaml --trainer.accelerator=cpu --trainer.devices=3 --trainer.num_nodes=3"
    assert trains in command


def test_an_elastic_job_gives_torchrun_a_range_of_nodes_and_the_strategy_its_least(parsed, node):
    command = succeeded(parsed, "dry run, torchrun").strip().splitlines()[-1]
    assert (
        "-m torch.distributed.run --nnodes=2:3 --local-addr=127.0.0.1 "
        "--rdzv-conf=join_timeout=300,is_host=false,last_call_timeout=45 " in command
    )
    assert command.endswith("--trainer.num_nodes=3 --trainer.strategy.init_args.min_nodes=2")
    err = fails(node, "cpu:1", "0", MIN_NODES="2")
    assert "MIN_NODES=2 asks for an elastic job, which needs torchrun's rendezvous: set LAUNCHER=torchrun too" in err


@pytest.mark.distributed
def test_node_rank_must_be_below_num_nodes(in_training):
    paragraph = stopped_in_training(in_training, "rank 1 of 1 node")
    assert "NODE_RANK=1 is out of range: the config has trainer.num_nodes=1, so node ranks are 0..0" in paragraph


def test_node_rank_must_be_below_num_nodes_from_the_environment_before_the_config_is_parsed(node):
    err = fails(node, "cpu:1", "2", NUM_NODES="2")
    assert "NODE_RANK=2 is out of range: NUM_NODES=2, so node ranks are 0..1" in err


@pytest.mark.distributed
def test_config_error_stops_before_training(in_training):
    assert stopped_in_training(in_training, "config error") == "error: unrecognized arguments: --trainer.max_epochz=3"


@pytest.mark.distributed
def test_a_run_id_that_is_a_path_stops_before_training(in_training, node):
    paragraph = stopped_in_training(in_training, "run id that is a path")
    assert "RUN_ID='../../elsewhere' is not a run name: use letters, digits" in paragraph
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


def test_gpu_check_says_a_process_sees_one_mig_device(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(MIG_IDS))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    why = gpu_check.problem(2)
    assert why.startswith(f"the GPU list names 2 GPU(s) (CUDA_VISIBLE_DEVICES={','.join(MIG_IDS)}), but torch sees 1")
    assert "CUDA shows a process only the first MIG device of its list" in why and why.endswith("Nothing was launched.")


@pytest.mark.distributed
def test_unreachable_master_fails_after_the_timeout(in_training):
    paragraph = stopped_in_training(in_training, "unreachable master")
    # How much longer it ran than a case that stops right after the same parse: the wait, under CONNECT_TIMEOUT=3
    # rather than the 300 of scripts/cluster.env.
    assert in_training["unreachable master"][3] - in_training["rank 1 of 1 node"][3] < 150
    port = IN_TRAINING["unreachable master"][1]["MASTER_PORT"]
    assert paragraph.startswith(
        f"error: node 1 cannot reach the master at 127.0.0.1:{port} after CONNECT_TIMEOUT 0:00:03. Check that node 0 "
    )
    assert f"the master's firewall lets this node reach that port (e.g. sudo ufw allow {port}/tcp)" in paragraph


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


@pytest.mark.parametrize(
    "gpus", ["abc", "0,,1", "-1", "0;1", "cpu:0", "cpu:x", "gpu:2", "", "GPU-", "GPU-xyz", "MIG-GPU-8932f937/1"]
)
def test_bad_gpu_list_is_rejected(node, gpus):
    err = fails(node, gpus, "0")
    assert f"GPUS={gpus} is neither a comma-separated list of GPU ids (e.g. 0,1) or UUIDs (GPU-..., MIG-..." in err


@pytest.mark.parametrize("gpus", ["0,1,0,3,3", f"{GPU_UUIDS[0]},{GPU_UUIDS[1]},{GPU_UUIDS[0]}"])
def test_duplicate_gpu_ids_are_named(node, gpus):
    repeated = "0,3" if gpus[0] == "0" else GPU_UUIDS[0]
    assert f"GPUS={gpus} lists GPU {repeated} more than once" in fails(node, gpus, "0")


def test_a_gpu_beyond_those_a_scheduler_gave_stops_naming_both(node):
    err = fails(node, "2", "0", CUDA_VISIBLE_DEVICES="2,3")
    assert "GPUS=2 asks for GPU 2, but CUDA_VISIBLE_DEVICES=2,3, set before the launcher started" in err
    assert "holds 2 GPU(s)" in err and "(GPUS=0 means GPU 2), so use ids 0..1" in err
    assert err.strip().endswith("Nothing was launched.")


def test_a_uuid_the_scheduler_did_not_give_stops(node):
    err = fails(node, GPU_UUIDS[1], "0", CUDA_VISIBLE_DEVICES=GPU_UUIDS[0])
    assert f"GPUS={GPU_UUIDS[1]} names {GPU_UUIDS[1]}, which CUDA_VISIBLE_DEVICES={GPU_UUIDS[0]}," in err


@pytest.mark.parametrize("inherited", ["NoDevFiles", "-1", "0,,1", "2,2", "GPU-xyz"])
def test_a_gpu_list_from_a_scheduler_that_cuda_cannot_read_stops(node, inherited):
    err = fails(node, "0", "0", CUDA_VISIBLE_DEVICES=inherited)
    assert f"CUDA_VISIBLE_DEVICES={inherited}, set before the launcher started" in err
    assert "is not a comma-separated list of distinct GPU ids or UUIDs, so GPUS=0 cannot pick GPUs from it" in err


@pytest.mark.parametrize("name", ["^docker", "=eth0", "eth0 eth1"])
def test_socket_ifname_must_name_interfaces(node, name):
    err = fails(node, "cpu:1", "0", SOCKET_IFNAME=name)
    assert f"SOCKET_IFNAME={name} is not an interface name" in err and "set NCCL_SOCKET_IFNAME itself" in err


@pytest.mark.parametrize("rank", ["x", "-1", "1.5"])
def test_node_rank_must_be_an_integer(node, rank):
    assert f"NODE_RANK={rank} is not a non-negative integer" in fails(node, "cpu:1", rank)


def write_settings(node: Path, text: str) -> str:
    path = node / "scripts" / "test-cluster.env"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("rank", "nodes"), [("1", "2"), ("0", "2"), ("0", "")], ids=["worker", "master", "one node"])
def test_a_master_addr_that_does_not_resolve_is_named(node, rank, nodes):
    err = fails(node, "cpu:2", rank, MASTER_ADDR="no-such-host.invalid", NUM_NODES=nodes)
    assert err.startswith(
        "error: MASTER_ADDR=no-such-host.invalid does not resolve to an IPv4 address on this node (getent ahostsv4 "
        "no-such-host.invalid finds none). Check its spelling, or set MASTER_ADDR to node 0's IP address"
    )
    assert err.strip().endswith("Nothing was launched.")


def test_missing_settings_are_named(node):
    settings = write_settings(node, "MASTER_ADDR=127.0.0.1\nCONFIGS=configs/ddp.yaml\n")
    err = fails(node, "cpu:1", "0", CLUSTER_ENV=settings)
    assert f"MASTER_PORT is not set. Set it in {settings}" in err


def test_an_empty_master_addr_is_this_machine(node):
    env, _ = validated(node, "cpu:1", "0", MASTER_ADDR="")
    assert env["MASTER_ADDR"] == "127.0.0.1"


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


@pytest.mark.parametrize("script", ["run_ddp_train.sh", "launch_cluster.sh", "doctor.sh"])
def test_a_launcher_run_by_sh_says_to_run_it_with_bash(script):
    shell = shutil.which("dash") or shutil.which("sh")
    result = subprocess.run([shell, f"scripts/{script}", "0", "0"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2
    assert (
        result.stderr == f"error: scripts/{script} is a bash script; run it as scripts/{script} or with bash, not sh.\n"
    )
