"""The launchers and the doctor on a machine without iproute2 (no ip, no ss), as stock GPU, cluster and container
images are: the interface to MASTER_ADDR, this node's address towards it and who holds MASTER_PORT come from
scripts/network.py, and agree with what ip and ss say where they are installed. A PATH of links to every other
command hides ip and ss."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, copy_project, finish, free_port, launch, launcher_env
from tests.helpers.hosts import network_namespaces, ssh_servers

HIDDEN = ("ip", "ss")
IP = shutil.which("ip") or "ip"  # for `ip netns exec`, which then runs a command that has no ip on its PATH


@pytest.fixture(scope="module")
def without_iproute2(tmp_path_factory) -> str:
    """A PATH on which every command of this one is found but ip and ss."""
    links = tmp_path_factory.mktemp("path")
    for directory in map(Path, os.environ["PATH"].split(os.pathsep)):
        for command in sorted(directory.iterdir()) if directory.is_dir() else []:
            link = links / command.name
            if command.name not in HIDDEN and not link.is_symlink():
                link.symlink_to(command)
    return str(links)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    return copy_project(tmp_path_factory.mktemp("node"))


def common(function: str, argument: str, path: str, netns: str | None = None) -> subprocess.CompletedProcess:
    """``function argument`` of scripts/common.sh, as the launcher calls it, with ``path`` as PATH."""
    command = ["bash", "-c", f'source scripts/common.sh && {function} "$1"', "common", argument]
    if netns:
        command = [IP, "netns", "exec", netns, *command]
    env = {**os.environ, "PATH": path, "PYTHON": sys.executable}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_without_ip_each_host_finds_the_route_ip_finds(two_hosts, without_iproute2):
    for host, other in (two_hosts, two_hosts[::-1]):
        expected = {
            other["address"]: f"remote {host['address']} {host['interface']}",
            host["address"]: f"local {host['address']} {host['interface']}",
            "127.0.0.1": "local 127.0.0.1 lo",
        }
        for address, route in expected.items():
            for path in (os.environ["PATH"], without_iproute2):
                found = common("route_to", address, path, host["netns"])
                assert (found.returncode, found.stdout.strip()) == (0, route), (address, path, found.stderr)
        for path in (os.environ["PATH"], without_iproute2):  # a host of the bridge alone has no default route
            found = common("route_to", "192.0.2.1", path, host["netns"])
            assert (found.returncode, found.stdout, found.stderr) == (1, "", ""), path


def test_without_ss_the_process_on_the_port_is_named(without_iproute2):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = str(listener.getsockname()[1])
        name = Path("/proc/self/comm").read_text().strip()
        for path in (os.environ["PATH"], without_iproute2):
            assert common("port_holder", port, path).stdout == f"{name} (pid {os.getpid()})\n", path
    assert common("port_holder", port, without_iproute2).stdout.strip() == ""


def test_without_iproute2_rank_zero_names_who_holds_the_master_port(node, without_iproute2):
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        port = str(listener.getsockname()[1])
        done = subprocess.run(
            [str(node / "scripts" / "run_ddp_train.sh"), "cpu:1", "0"],
            env=launcher_env(PATH=without_iproute2, MASTER_PORT=port),
            capture_output=True,
            text=True,
            timeout=120,
        )
    name = Path("/proc/self/comm").read_text().strip()
    assert done.returncode == 2
    assert done.stderr == (
        f"error: MASTER_PORT {port} is already in use on the master, by {name} (pid {os.getpid()}), perhaps an earlier "
        "run still going. Stop it, or choose another free port as MASTER_PORT in scripts/cluster.env (the same on "
        "every node). Nothing was launched.\n"
    )


def on_host(host: dict, script: Path, *args: str, **settings: str) -> subprocess.Popen:
    """``script ARGS`` on ``host`` without iproute2, its output in a pipe."""
    return subprocess.Popen(
        [IP, "netns", "exec", host["netns"], str(script), *args],
        env=launcher_env(**settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_without_iproute2_a_worker_exports_its_interface_and_address(node, two_hosts, without_iproute2):
    master_host, worker_host = two_hosts
    settings = {"MASTER_ADDR": master_host["address"], "NUM_NODES": "2", "DRY_RUN": "1", "LAUNCHER": "torchrun"}
    script = node / "scripts" / "run_ddp_train.sh"
    output = finish(on_host(worker_host, script, "cpu:1", "1", PATH=without_iproute2, **settings))
    assert f"export GLOO_SOCKET_IFNAME={worker_host['interface']}\n" in output
    assert f"export NCCL_SOCKET_IFNAME={'=' + worker_host['interface']}\n" in output
    assert f" --local-addr={worker_host['address']} " in output


@pytest.mark.distributed
def test_without_iproute2_the_main_command_trains(tmp_path, without_iproute2):
    node = copy_project(tmp_path / "node")
    settings = {"PATH": without_iproute2, "MASTER_PORT": str(free_port())}
    output = finish(launch(node, "cpu:2", 0, "--trainer.max_epochs=1", **settings))
    assert "GLOO_SOCKET_IFNAME=lo" in output
    assert "Process group started: gloo, 2 processes" in output
    assert (node / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.distributed
def test_without_iproute2_the_doctor_passes(tmp_path, without_iproute2):
    node = copy_project(tmp_path / "node")
    settings = {"PATH": without_iproute2, "MASTER_PORT": str(free_port()), "NUM_NODES": "1"}
    doctor = subprocess.run(
        [str(node / "scripts" / "doctor.sh"), "cpu:1", "0"],
        env=launcher_env(**settings),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "ok    network interface lo (NCCL_SOCKET_IFNAME==lo GLOO_SOCKET_IFNAME=lo)" in doctor.stdout
    assert doctor.stdout.rstrip().endswith("ok    the doctor found nothing wrong")


@pytest.mark.distributed
def test_without_iproute2_one_command_trains_on_two_hosts(tmp_path, without_iproute2):
    project = copy_project(tmp_path / "project")  # on a file system both hosts share, as on NFS
    # A setting of the cluster's file reaches every node: the nodes' PATH, which sshd would set, lacks ip and ss too.
    settings_file = project / "scripts" / "no_iproute2.env"
    settings_file.write_text((project / "scripts" / "cluster.env").read_text() + "PATH=\n")
    with network_namespaces(f"{os.getpid() % 100000}i") as hosts, ssh_servers(hosts, tmp_path) as ssh_config:
        (tmp_path / "hosts").write_text("".join(f"{host['address']}\n" for host in hosts))
        settings = {"PATH": without_iproute2, "CLUSTER_ENV": str(settings_file), "SSH_OPTS": f"-F {ssh_config}"}
        script = project / "scripts" / "launch_cluster.sh"
        output = finish(
            on_host(hosts[0], script, str(tmp_path / "hosts"), "cpu:1", "--trainer.max_epochs=1", **settings)
        )
    assert "[node 0 10.231.0.1] Process group started: gloo, 2 processes" in output
    for rank, host in enumerate(hosts):
        log = (project / "logs" / "nodes" / f"node{rank}.log").read_text()
        assert f"GLOO_SOCKET_IFNAME={host['interface']}" in log, "the node ran on another host"
        assert f"\nPATH={without_iproute2}\n" in log, "the node could use ip"
    assert output.rstrip().endswith("every node finished")
