"""Hosts for multi-host tests: network namespaces on one bridge, and an OpenSSH server in each."""

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SSHD = Path("/usr/sbin/sshd")


@contextlib.contextmanager
def network_namespaces(tag: str, count: int = 2) -> Iterator[list[dict]]:
    """``count`` network namespaces on one switch (a bridge in a namespace of its own): separate hosts with their
    own addresses and interfaces. Setting a host's interface down cuts it off as an unplugged machine would be."""
    switch = f"ddp{tag}s"
    hosts = [
        {"netns": f"ddp{tag}{letter}", "interface": f"vddp{tag}{letter}", "address": f"10.231.0.{number}"}
        for number, letter in enumerate("abcdefgh"[:count], start=1)
    ]
    setup = [
        ["ip", "netns", "add", switch],
        ["ip", "-n", switch, "link", "add", "switch", "type", "bridge"],
        ["ip", "-n", switch, "link", "set", "switch", "up"],
    ]
    for host in hosts:
        port = f"s{host['interface'][1:]}"
        setup += [
            ["ip", "netns", "add", host["netns"]],
            ["ip", "link", "add", host["interface"], "type", "veth", "peer", "name", port],
            ["ip", "link", "set", host["interface"], "netns", host["netns"]],
            ["ip", "link", "set", port, "netns", switch],
            ["ip", "-n", switch, "link", "set", port, "master", "switch", "up"],
            ["ip", "-n", host["netns"], "addr", "add", f"{host['address']}/24", "dev", host["interface"]],
            ["ip", "-n", host["netns"], "link", "set", host["interface"], "up"],
            ["ip", "-n", host["netns"], "link", "set", "lo", "up"],
        ]
    try:
        for command in setup:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"cannot create network namespaces here ({' '.join(command)}: {done.stderr.strip()})")
        yield hosts
    finally:
        for netns in [host["netns"] for host in hosts] + [switch]:
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True)


def set_link(host: dict, state: str) -> None:
    """Set the host's interface ``down`` (cut off, as an unplugged machine) or ``up``."""
    subprocess.run(["ip", "-n", host["netns"], "link", "set", host["interface"], state], check=True)


def keygen(path: Path) -> str:
    """A new ed25519 key pair without a passphrase at ``path``; returns the public key."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return Path(f"{path}.pub").read_text().strip()


@contextlib.contextmanager
def ssh_servers(hosts: list[dict], directory: Path, timeout: float = 60) -> Iterator[Path]:
    """An sshd on port 22 of each host's address, its keys and configuration in ``directory``, logging to
    ``sshd-<address>.log`` there. Yields an ssh client configuration (for ``ssh -F``) that logs in as this user
    with a throw-away key and knows the hosts' keys."""
    if not SSHD.exists():
        pytest.skip(f"{SSHD} is missing: install Debian's openssh-server (.ci/run does)")
    # sshd checks for its privilege separation directory, which its service creates at boot.
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    client_key = directory / "client_key"
    (directory / "authorized_keys").write_text(keygen(client_key) + "\n")
    known_hosts, servers = [], []
    try:
        for host in hosts:
            name = f"sshd-{host['address']}"
            host_key = directory / f"{name}.key"
            known_hosts.append(f"{host['address']} {keygen(host_key)}")
            config = directory / f"{name}.conf"
            config.write_text(
                f"ListenAddress {host['address']}:22\nHostKey {host_key}\nPidFile {directory / name}.pid\n"
                f"AuthorizedKeysFile {directory / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                "PrintMotd no\n"
            )
            log = directory / f"{name}.log"
            with log.open("w") as output:
                command = ["ip", "netns", "exec", host["netns"], str(SSHD), "-D", "-e", "-f", str(config)]
                servers.append(subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd="/"))
            deadline = time.monotonic() + timeout
            while f"Server listening on {host['address']} port 22" not in log.read_text():
                assert servers[-1].poll() is None, f"sshd ended: {log.read_text()}"
                assert time.monotonic() < deadline, f"sshd did not listen within {timeout} s: {log.read_text()}"
                time.sleep(0.05)
        (directory / "known_hosts").write_text("\n".join(known_hosts) + "\n")
        client = directory / "ssh_config"
        client.write_text(
            f"IdentityFile {client_key}\nIdentitiesOnly yes\nUserKnownHostsFile {directory / 'known_hosts'}\n"
            "StrictHostKeyChecking yes\n"
        )
        yield client
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=60)
