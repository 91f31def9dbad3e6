"""The start-up handshake of a distributed job.

Every process reports to global rank 0 (its node, host and settings) through the job's TCPStore before the
process group starts. Rank 0 checks that everybody arrived and that all agree, and otherwise stops the whole
job with one paragraph naming who is missing or what differs, instead of a hang or a bare store timeout.
"""

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from torch.distributed import Store

from training.job.join_progress import WaitReport, waited_of, waiting

PREFIX = "startup"
# How long the other processes wait for rank 0's verdict beyond the join timeout itself.
VERDICT_GRACE = timedelta(seconds=30)

FIXES = {
    "num_nodes": "set trainer.num_nodes (or NUM_NODES) to the same value on every node",
    "devices per node": "start every node with the same number of GPUs (or cpu:N processes)",
    "torch": "install the same requirements.txt on every node",
    "lightning": "install the same requirements.txt on every node",
    "project code": "check out the same commit on every node (git status shows local edits)",
    "config": "start every node with the same config files and arguments (each node's log starts with its command)",
    "checkpoint": "keep logs/ on storage every node shares, or copy the checkpoint to the same path on every node",
}


class StartupError(RuntimeError):
    """A distributed job that cannot start, explained in one paragraph."""


class Stopped(StartupError):
    """A job told to stop (SIGTERM) before training started."""


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


def handshake(
    store: Store,
    me: Member,
    *,
    num_nodes: int,
    devices: int,
    timeout: timedelta,
    address: str,
    leader: bool,
    fail_fast: bool = True,
    advice: str = "",
    abandoned: Callable[[], str] = str,
) -> Roster:
    """Report ``me`` and return the roster of the whole job, or raise StartupError.

    ``leader`` (global rank 0) waits up to ``timeout`` for ``num_nodes * devices`` processes; a missing one
    raises. With ``fail_fast`` the first process that disagrees raises at once; otherwise the leader waits
    for all and the roster names every difference. The other processes receive the leader's verdict, so
    every node stops with the same words. ``advice`` ends the leader's paragraph on missing processes.
    ``abandoned`` says why this process stops waiting ("" while it waits on): a process of its node ended, or the
    job was told to stop; the leader then stops the whole job with those words at once.
    """
    index = store.add(f"{PREFIX}/count", 1) - 1
    store.set(f"{PREFIX}/member/{index}", json.dumps(asdict(me)))
    if leader:
        try:
            roster = _gather(store, me, num_nodes, devices, timeout, address, fail_fast, advice, abandoned)
        except StartupError as error:
            store.set(f"{PREFIX}/verdict", json.dumps({"error": str(error)}))
            if not isinstance(error, Stopped):  # a stopped node stops now: its launcher would kill it soon after
                _await_readers(store)
            raise
        store.set(f"{PREFIX}/verdict", json.dumps(asdict(roster)))
        if roster.problems:
            _await_readers(store)
        return roster
    try:
        _await_verdict(store, me, num_nodes * devices, timeout, address, abandoned)
    except StartupError as error:
        with contextlib.suppress(RuntimeError):  # the leader stops the job with this process's words
            store.set(f"{PREFIX}/abandoned", str(error))
            store.add(f"{PREFIX}/read", 1)  # it knows the verdict: the leader waits for none from it
        raise
    except RuntimeError as error:  # torch's DistStoreError and DistNetworkError derive from it
        raise StartupError(
            f"{me.where}: no word from global rank 0 within {timeout + VERDICT_GRACE} after joining at {address}. "
            "Node 0 stopped or lost the connection: its log says why. Once it runs again, the same command on every "
            "node starts the job."
        ) from error
    verdict = json.loads(store.get(f"{PREFIX}/verdict"))
    store.add(f"{PREFIX}/read", 1)
    if "error" in verdict:
        raise StartupError(verdict["error"])
    return Roster([Member(**member) for member in verdict["members"]], verdict["problems"])


def refuse(store: Store, error: str, expected: int, timeout: timedelta) -> None:
    """Global rank 0's verdict before the others report: each process that reports gets ``error`` from
    ``handshake`` as a StartupError, at once, and stops with it. Returns once ``expected`` processes have read it,
    or after ``timeout``; the store (this process's) must stay up until then."""
    store.set(f"{PREFIX}/verdict", json.dumps({"error": error}))
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(f"{PREFIX}/read", 0) < expected and time.monotonic() < deadline:
        time.sleep(0.05)


def _await_verdict(
    store: Store, me: Member, expected: int, timeout: timedelta, address: str, abandoned: Callable[[], str]
) -> None:
    """Wait for global rank 0's verdict; the first process of a node says how many have joined meanwhile."""
    report = WaitReport() if me.local_rank == 0 else None
    started = time.monotonic()
    try:
        while not store.check([f"{PREFIX}/verdict"]):
            waited = time.monotonic() - started
            if waited > (timeout + VERDICT_GRACE).total_seconds():
                raise RuntimeError("no verdict")
            if why := abandoned():
                raise StartupError(why)
            if report and report.due <= waited:
                joined = store.add(f"{PREFIX}/count", 0)
                report.show(
                    waited,
                    f"{me.where} joined the job at {address} and waits for global rank 0's word: {joined} of "
                    f"{expected} processes joined, {waited_of(waited, timeout)}.",
                )
            time.sleep(0.05)
    finally:
        if report:
            report.close()


def _await_readers(store: Store) -> None:
    """Keep the store (hosted by the leader's process) up until every process that reported has read a
    negative verdict, so each node stops with the reason rather than a lost connection; bounded by
    VERDICT_GRACE for a process that died meanwhile."""
    others = store.add(f"{PREFIX}/count", 0) - 1
    deadline = time.monotonic() + VERDICT_GRACE.total_seconds()
    while store.add(f"{PREFIX}/read", 0) < others and time.monotonic() < deadline:
        time.sleep(0.05)


def describe(roster: Roster) -> str:
    """The paragraph that explains the disagreements of a roster."""
    return _disagreement(roster.problems)


def _gather(
    store: Store,
    leader: Member,
    num_nodes: int,
    devices: int,
    timeout: timedelta,
    address: str,
    fail_fast: bool,
    advice: str,
    abandoned: Callable[[], str],
) -> Roster:
    expected = {(node, local) for node in range(num_nodes) for local in range(devices)}
    arrived: dict[tuple[int, int], Member] = {}
    everyone: list[Member] = []
    problems: list[str] = []
    read = 0
    started = time.monotonic()
    report = WaitReport()
    try:
        while True:
            count = store.add(f"{PREFIX}/count", 0)
            for index in range(read, count):
                member = Member(**json.loads(store.get(f"{PREFIX}/member/{index}")))
                everyone.append(member)
                found = _check(member, leader, arrived, num_nodes)
                arrived.setdefault((member.node_rank, member.local_rank), member)
                problems.extend(p for p in found if p not in problems)
                if found and fail_fast:
                    raise StartupError(_disagreement(problems))
            read = count
            if expected <= arrived.keys():
                members = sorted(everyone, key=lambda m: (m.node_rank, m.local_rank, m.pid))
                return Roster(members, problems)
            if why := abandoned() or (store.check([f"{PREFIX}/abandoned"]) and store.get(f"{PREFIX}/abandoned")):
                raise StartupError(why if isinstance(why, str) else why.decode())
            waited = time.monotonic() - started
            if waited > timeout.total_seconds():
                raise StartupError(_missing(arrived, num_nodes, devices, timeout, address, problems) + advice)
            if report.due <= waited:
                report.show(waited, waiting(arrived, num_nodes, devices, waited, timeout, address))
            time.sleep(0.05)
    finally:
        report.close()


def _check(member: Member, leader: Member, arrived: dict[tuple[int, int], Member], num_nodes: int) -> list[str]:
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


def _disagreement(problems: list[str]) -> str:
    fixes = [fix for key, fix in FIXES.items() if any(p.startswith(key) for p in problems)]
    to_fix = f" To fix: {'; '.join(dict.fromkeys(fixes))}." if fixes else ""
    return f"the job cannot start, its processes disagree: {'; '.join(problems)}.{to_fix}"


def _missing(
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
