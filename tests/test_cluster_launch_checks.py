"""scripts/launch_cluster.sh without connecting to any host: its dry run, and every kind of bad input it stops at.
tests/test_cluster_launch.py runs it on real hosts."""

import shlex
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, launcher_env

LAUNCHER = str(REPO / "scripts" / "launch_cluster.sh")
HOSTS = "# the cluster\nhost-a    # the master\n\n  me@host-b\n"


def run(hostfile: Path | str, *args: str, **settings: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LAUNCHER, str(hostfile), *args],
        env=launcher_env(**settings),
        capture_output=True,
        text=True,
        timeout=60,
    )


def dry_run(tmp_path: Path, *args: str, **settings: str) -> list[list[str]]:
    """Each node's ssh command from the dry run, as words, and what it runs on the host, as words."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text(HOSTS)
    done = run(hostfile, *args, DRY_RUN="1", **settings)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"# 2 node(s) from {hostfile}") and lines[1::2] == ["# node 0", "# node 1"]
    return [shlex.split(line) for line in lines[2::2]]


def node_environment(remote: list[str]) -> dict[str, str]:
    env_words = remote[remote.index("env") + 1 : remote.index("./scripts/run_ddp_train.sh")]
    return dict(word.split("=", 1) for word in env_words)


def test_dry_run_prints_the_ssh_command_of_every_node(tmp_path):
    settings = {"SSH_OPTS": "-i /keys/cluster -p 2222", "RUN_ID": "exp-7", "LAUNCHER": "torchrun", "PYTHON": "py3"}
    nodes = dry_run(tmp_path, "0,1", "--trainer.max_epochs=3", "--model.init_args.name=it's mine", **settings)
    for rank, (host, words) in enumerate(zip(["host-a", "me@host-b"], nodes, strict=True)):
        assert words[:3] == ["ssh", "-o", "BatchMode=yes"], "the user's options must not turn questions back on"
        assert words[3:7] == ["-i", "/keys/cluster", "-p", "2222"] and words[-3:-1] == ["-T", host]
        remote = shlex.split(words[-1])
        assert remote[:5] == ["cd", str(REPO), "&&", "exec", "env"]
        assert remote[remote.index("./scripts/run_ddp_train.sh") :] == [
            "./scripts/run_ddp_train.sh",
            "0,1",
            str(rank),
            "--trainer.max_epochs=3",
            "--model.init_args.name=it's mine",
        ]
        env = node_environment(remote)
        assert env["MASTER_ADDR"] == "host-a" and env["NUM_NODES"] == "2" and env["STOP_WITH_STDIN"] == "1"
        assert (env["RUN_ID"], env["LAUNCHER"], env["PYTHON"], env["STOP_TIMEOUT"]) == (
            "exp-7",
            "torchrun",
            "py3",
            "30",
        )
        assert env["CONFIGS"] == "configs/ddp.yaml" and env["NCCL_IB_DISABLE"] == "", "cluster.env as it is here"


def test_master_addr_from_the_environment_or_the_settings_file_wins_over_the_first_host(tmp_path):
    for words in dry_run(tmp_path, "cpu:2", MASTER_ADDR="10.0.0.1"):
        assert node_environment(shlex.split(words[-1]))["MASTER_ADDR"] == "10.0.0.1"
    settings = tmp_path / "cluster.env"
    settings.write_text("MASTER_ADDR=10.0.0.2\nMASTER_PORT=29600\nCONFIGS=configs/ddp.yaml\n")
    for words in dry_run(tmp_path, "cpu:2", CLUSTER_ENV=str(settings), PROJECT_DIR="/srv/project"):
        remote = shlex.split(words[-1])
        env = node_environment(remote)
        assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["CLUSTER_ENV"]) == ("10.0.0.2", "29600", str(settings))
        assert remote[1] == "/srv/project"


@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        ("host-a slots=2\n", "hosts:1: expected one host as ssh reaches it (host-a, 10.0.0.2 or user@host-a), got: "),
        ("host-a slots=2\n", "got: host-a slots=2. Every host runs the GPUs of GPUS, the launcher's second argument"),
        ("host-a\n-oProxyCommand=x\n", "hosts:2: expected one host as ssh reaches it"),
        ("host-a\n\nme@host-a\n", "hosts:3: host-a is listed again (first on line 1). List each host once"),
        ("# nobody\n\n", "lists no host. Write one host per line (host or user@host), node 0 first."),
    ],
)
def test_a_malformed_hostfile_is_named_with_its_line(tmp_path, hosts, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(hosts)
    done = run(hostfile, "cpu:1")
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("args", "settings", "message"),
    [
        (("cpu:x",), {}, "GPUS=cpu:x is neither a comma-separated list of GPU ids"),
        (("0,0",), {}, "GPUS=0,0 lists GPU 0 more than once"),
        (("cpu:1",), {"NUM_NODES": "3"}, "NUM_NODES=3 is set, but "),
        (("cpu:1",), {"PROJECT_DIR": "project"}, "PROJECT_DIR=project is not an absolute path"),
        (("cpu:1",), {"STOP_TIMEOUT": "soon"}, "STOP_TIMEOUT=soon is not a number of seconds"),
        (("cpu:1",), {"CLUSTER_ENV": "/nowhere/cluster.env"}, "settings file /nowhere/cluster.env not found"),
    ],
)
def test_bad_arguments_and_settings_stop_before_any_connection(tmp_path, args, settings, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(HOSTS)
    done = run(hostfile, *args, **settings)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_missing_hostfile_or_argument_is_named(tmp_path):
    done = run(tmp_path / "hosts", "cpu:1")
    assert done.returncode == 2 and f"hostfile {tmp_path / 'hosts'} not found" in done.stderr
    done = subprocess.run([LAUNCHER, "hosts"], capture_output=True, text=True, timeout=60)
    assert (
        done.returncode == 2 and "./scripts/launch_cluster.sh HOSTFILE GPUS [extra cli.py arguments...]" in done.stderr
    )


def test_a_relative_hostfile_is_read_from_the_callers_directory(tmp_path):
    (tmp_path / "hosts").write_text("solo\n")
    done = subprocess.run(
        [LAUNCHER, "hosts", "cpu:1"], cwd=tmp_path, env=launcher_env(DRY_RUN="1"), capture_output=True, text=True
    )
    assert done.returncode == 0 and "# 1 node(s) from hosts," in done.stdout, done.stderr
