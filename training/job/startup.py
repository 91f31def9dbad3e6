"""The start-up handshake of a distributed job.

Every process reports to global rank 0 (its node, host and settings) through the job's TCPStore before the
process group starts. Rank 0 checks that everybody arrived and that all agree, and otherwise stops the whole
job with one paragraph naming who is missing or what differs, instead of a hang or a bare store timeout.
"""

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta

from torch.distributed import Store

from training.job.join_progress import WaitReport, waited_of, waiting
from training.job.roster import Member, Roster, check, disagreement, who_is_missing

PREFIX = "startup"
# How long the other processes wait for rank 0's verdict beyond the join timeout itself.
VERDICT_GRACE = timedelta(seconds=30)


class StartupError(RuntimeError):
    """A distributed job that cannot start, explained in one paragraph."""


class Stopped(StartupError):
    """A job told to stop (SIGTERM) before training started."""


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


def started_outside_advice(node_rank: int, local_rank: str | None) -> str:
    """What to do when the processes of node ``node_rank`` never all arrive because Lightning, given ``LOCAL_RANK``
    (``local_rank``, None when unset), started only the one process and expected the others to be started by hand.
    A LOCAL_RANK left in a shell does this: hand-written launch scripts export it."""
    if local_rank is None:
        return ""
    return (
        f" Node {node_rank} was started with LOCAL_RANK={local_rank} in its environment, so"
        " Lightning started no other process there and expected each to be started by hand: unset LOCAL_RANK"
        " (and WORLD_SIZE, NODE_RANK) to have it start one process per device, or start them with"
        " scripts/run_ddp_train.sh."
    )


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
                found = check(member, leader, arrived, num_nodes)
                arrived.setdefault((member.node_rank, member.local_rank), member)
                problems.extend(p for p in found if p not in problems)
                if found and fail_fast:
                    raise StartupError(disagreement(problems))
            read = count
            if expected <= arrived.keys():
                members = sorted(everyone, key=lambda m: (m.node_rank, m.local_rank, m.pid))
                return Roster(members, problems)
            if why := abandoned() or (store.check([f"{PREFIX}/abandoned"]) and store.get(f"{PREFIX}/abandoned")):
                raise StartupError(why if isinstance(why, str) else why.decode())
            waited = time.monotonic() - started
            if waited > timeout.total_seconds():
                raise StartupError(who_is_missing(arrived, num_nodes, devices, timeout, address, problems) + advice)
            if report.due <= waited:
                report.show(waited, waiting(arrived, num_nodes, devices, waited, timeout, address))
            time.sleep(0.05)
    finally:
        report.close()
