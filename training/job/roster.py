"""Who joined a distributed job and what its processes disagree on, in the words the handshake stops with."""

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

FIXES = {
    "num_nodes": "set trainer.num_nodes (or NUM_NODES) to the same value on every node",
    "devices per node": "start every node with the same number of GPUs (or cpu:N processes)",
    "torch": "install the same requirements.txt on every node",
    "lightning": "install the same requirements.txt on every node",
    "project code": "check out the same commit on every node (git status shows local edits)",
    "config": "start every node with the same config files and arguments (each node's log starts with its command)",
    "checkpoint": "keep logs/ on storage every node shares, or copy the checkpoint to the same path on every node",
}


@dataclass
class Member:
    """What one process reports about itself."""

    node_rank: int
    local_rank: int
    host: str
    pid: int
    facts: dict[str, Any]
    device: str = ""

    @property
    def where(self) -> str:
        return f"node {self.node_rank} ({self.host})"


@dataclass
class Roster:
    """Every process that reported, in (node, local rank) order, and what they disagree on."""

    members: list[Member]
    problems: list[str]


def describe(roster: Roster) -> str:
    """The paragraph that explains the disagreements of a roster."""
    return disagreement(roster.problems)


def check(member: Member, leader: Member, arrived: dict[tuple[int, int], Member], num_nodes: int) -> list[str]:
    differences = [_difference(key, leader, member) for key in sorted(leader.facts.keys() | member.facts.keys())]
    if any(differences):
        return [d for d in differences if d]
    twin = arrived.get((member.node_rank, member.local_rank))
    if twin is not None:
        return [
            f"node rank {member.node_rank} was started twice, on {twin.host} (pid {twin.pid}) and on "
            f"{member.host} (pid {member.pid}): give every node its own NODE_RANK"
        ]
    if member.node_rank >= num_nodes:
        return [
            f"{member.where} arrived, but the job has num_nodes={num_nodes} (node ranks 0..{num_nodes - 1}): "
            "check NODE_RANK on that node"
        ]
    return []


def _difference(key: str, leader: Member, member: Member) -> str:
    ours, theirs = leader.facts.get(key), member.facts.get(key)
    if ours == theirs:
        return ""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        keys = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        shown = ", ".join(f"{k} ({ours.get(k, 'unset')} vs {theirs.get(k, 'unset')})" for k in keys[:5])
        more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
        return f"{key} differs between {leader.where} and {member.where}: {shown}{more}"
    return f"{key}: {leader.where} has {ours}, {member.where} has {theirs}"


def disagreement(problems: list[str]) -> str:
    fixes = [fix for key, fix in FIXES.items() if any(p.startswith(key) for p in problems)]
    to_fix = f" To fix: {'; '.join(dict.fromkeys(fixes))}." if fixes else ""
    return f"the job cannot start, its processes disagree: {'; '.join(problems)}.{to_fix}"


def who_is_missing(
    arrived: dict[tuple[int, int], Member],
    num_nodes: int,
    devices: int,
    timeout: timedelta,
    address: str,
    problems: list[str],
) -> str:
    absent_nodes = [node for node in range(num_nodes) if not any(n == node for n, _ in arrived)]
    parts = [f"the job cannot start: only {len(arrived)} of {num_nodes * devices} processes joined within {timeout}"]
    if absent_nodes:
        parts.append(f"node rank{'s' if len(absent_nodes) > 1 else ''} {_listed(absent_nodes)} never arrived")
    for node in sorted({n for n, _ in arrived}):
        missing = [local for local in range(devices) if (node, local) not in arrived]
        if missing:
            parts.append(
                f"node {node} lacks local rank{'s' if len(missing) > 1 else ''} {_listed(missing)} "
                "(a process there stopped before joining)"
            )
    parts.extend(problems)
    nodes_setting = ""
    if absent_nodes:
        nodes_setting = (
            f" The job has num_nodes={num_nodes} (trainer.num_nodes in the config or on the command line, or NUM_NODES"
            f" in the environment): if it is meant to run on {_machines(num_nodes - len(absent_nodes))} only, set "
            f"num_nodes to {num_nodes - len(absent_nodes)}; otherwise start node rank {_listed(absent_nodes)} with "
            "the same command."
        )
    return (
        "; ".join(parts)
        + f".{nodes_setting} Check that every node was started with MASTER_ADDR and MASTER_PORT pointing at "
        f"{address}, that the master's firewall lets the other nodes reach that port, and the log of each missing "
        "node (logs/nodes/node<RANK>.log on that machine); then run the same command on every node again."
    )


def _machines(count: int) -> str:
    return "this machine" if count == 1 else f"{count} machines"


def _listed(numbers: list[int]) -> str:
    return ", ".join(str(n) for n in numbers)
