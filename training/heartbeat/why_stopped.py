"""The paragraphs that explain a job stopped by a lost peer, a failed peer or a collective that timed out.

A heartbeat (training/heartbeat/liveness.py) is a dict: ``rank``, ``node``, ``local``, ``host``, ``address``, ``state``
and, from global rank 0, the last complete ``checkpoint``.
"""

import os
import re
import shlex
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

from torch.distributed import DistError

from training.heartbeat.stall import SAVING_A_CHECKPOINT

# What gloo and NCCL say when a peer went away or a collective ran out of time.
COLLECTIVE_FAILURE = re.compile(r"gloo|nccl|connection (closed|reset|refused)|broken pipe|timed out|timeout", re.I)
TIMED_OUT = re.compile(r"timed out|timeout", re.I)


def is_collective_failure(error: BaseException) -> bool:
    return isinstance(error, DistError) or (
        isinstance(error, RuntimeError) and bool(COLLECTIVE_FAILURE.search(str(error)))
    )


def timed_out(error: BaseException) -> bool:
    return bool(TIMED_OUT.search(str(error)))


def one_line(error: BaseException) -> str:
    """The error's type and first sentence, without the source location gloo starts its messages with."""
    lines = str(error).strip().splitlines()
    first = re.sub(r"^\[[^\]]*\]\s*", "", lines[0] if lines else "")
    sentence = re.split(r"(?<=\.)\s", first, maxsplit=1)[0]
    text = f"{type(error).__name__}: {sentence}".strip()
    return text if len(text) <= 300 else text[:297] + "..."


def collective_name(error: BaseException) -> str:
    """The collective that ``error`` came out of, from its traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    calls = [frame.name for frame in frames if frame.filename.endswith("distributed_c10d.py")]
    if calls:
        return f"torch.distributed.{calls[0]}"
    if any("backward" in frame.name for frame in frames):
        return "DDP's gradient all-reduce during backward"
    return "a collective"


def launch_command() -> str:
    """The command that started this node: the launcher's (LAUNCH_COMMAND), else this process's."""
    return os.environ.get("LAUNCH_COMMAND") or shlex.join(["python", *sys.argv])


def where(beat: dict[str, Any]) -> str:
    place = ", ".join(part for part in (beat.get("host"), beat.get("address")) if part)
    return f"node {beat.get('node', '?')}" + (f" ({place})" if place else "")


def clock(wall: float) -> str:
    return f"{time.strftime('%H:%M:%S', time.localtime(wall))} ({time.time() - wall:.0f} s ago)"


def peers_lost(silent: dict[int, Any], beats: dict[int, dict[str, Any]], why: str, tail: str) -> str:
    """``silent``: rank -> its last Heard (None if never heard from); ``beats``: every rank's last heartbeat."""
    parts = []
    by_node: dict[Any, list[int]] = {}
    for rank in sorted(silent):
        by_node.setdefault(beats[rank]["node"] if rank in beats else None, []).append(rank)
    for node, ranks in by_node.items():
        if node is None:
            parts.append(f"process rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}, never heard from")
            continue
        last = max(silent[rank].changed_at for rank in ranks)
        whole = sorted(rank for rank, beat in beats.items() if beat.get("node") == node) == ranks
        who = where(beats[ranks[0]]) if whole else f"rank {', '.join(map(str, ranks))} of {where(beats[ranks[0]])}"
        parts.append(f"{who}, last heard from at {clock(last)}")
    return f"the job lost {'; '.join(parts)}: no heartbeat since, {why}. {tail}"


def store_lost(zero: dict[str, Any], store_address: str, heard_at: float, why: str, tail: str) -> str:
    return (
        f"the job lost {where({**zero, 'node': 0})}: the job's store at {store_address}, which global rank 0 holds "
        f"there, has not answered since {clock(heard_at)}, {why}. {tail}"
    )


def peer_failed(beat: dict[str, Any], error: str, tail: str) -> str:
    traceback_there = f"Its node's log ({beat['log']} there)" if beat.get("log") else "Its output on that node"
    return (
        f"rank {beat.get('rank')} (local rank {beat.get('local')}) of {where(beat)} stopped with an error: {error}. "
        f"{traceback_there} has the traceback; every other process stopped with it. {tail}"
    )


def own_error(me: dict[str, Any], error: str, tail: str) -> str:
    """What the process the user started says after its own error's traceback, once the node's others ended."""
    return (
        f"the job stopped: {who(me)} stopped with the error above ({error}); the rest of the job stopped with it. "
        f"{tail}"
    )


def process_ended(what: str, tail: str) -> str:
    """``what``: a process of this node that ended, and how (training/job/node_processes.py)."""
    return f"the job stopped: {what}, and the rest of the job stopped with it. {tail}"


def who(beat: dict[str, Any]) -> str:
    return f"rank {beat.get('rank')} (local rank {beat.get('local')}, pid {beat.get('pid')}) of {where(beat)}"


def at(beat: dict[str, Any]) -> str:
    """How far a process had got: its epoch and step in a fit, the batches it read in validate, test or predict."""
    if beat.get("run", "fit") == "fit":
        return f"at epoch {beat.get('epoch')}, step {beat.get('step')}"
    read = beat.get("read")
    return f"after {read} batch{'' if read == 1 else 'es'} of {beat['run']}"


def stall_report(beat: dict[str, Any], what: str, stall_timeout: timedelta, collective_timeout: timedelta) -> str:
    """What every node logs of a process that has made no progress for a while, as ``what`` says (stall.py)."""
    if what == SAVING_A_CHECKPOINT:
        busy = f"{who(beat)} has been {what} for {beat['quiet']:.0f} s ({at(beat)})"
        return f"note: {busy}; the other processes wait for it."
    stops = (
        f"The job stops once it has made none for trainer.strategy.init_args.stall_timeout ({stall_timeout})"
        if stall_timeout
        else f"The job waits for it up to the collective timeout ({collective_timeout}; stall_timeout is 0)"
    )
    if "worker" in beat and not beat["worker_stack"]:
        where = f"Its main thread waits for its DataLoader worker (pid {beat['worker']}), which is in {beat['place']}."
        stack = []
    elif "worker" in beat:
        where = f"Its main thread waits for its DataLoader worker (pid {beat['worker']}), which is at:"
        stack = beat["worker_stack"]
    else:
        where, stack = "Its main thread is at:", beat.get("stack", [])
    shown = "".join(stack).rstrip()
    return (
        f"warning: {who(beat)} has made no progress in {what} for {beat['quiet']:.0f} s ({at(beat)}), while the "
        f"other processes wait for it in a collective. {where}\n" + (f"{shown}\n" if shown else "") + f"{stops}."
    )


def stalled(beat: dict[str, Any], what: str, limit: str, tail: str) -> str:
    """The job stopped for a process that made no progress in ``what`` (stall.py) for longer than ``limit``: the
    stall_timeout, or the collective timeout another process waited in it for."""
    place = f"DataLoader worker (pid {beat['worker']})" if "worker" in beat else "main thread"
    if limit.startswith("stall_timeout"):
        instead = (
            "to wait for it up to the collective timeout instead, set trainer.strategy.init_args.stall_timeout to 0"
        )
    else:
        instead = "if such waits are expected, raise trainer.strategy.init_args.timeout"
    return (
        f"the job stopped: {who(beat)} made no progress in {what} for {beat['quiet']:.0f} s ({at(beat)}), longer than "
        f"{limit}, while the other processes waited for it in a collective. Its {place} was in {beat.get('place')}; "
        "every node's log shows its stack. A data loader that blocks (a dataset on a dead mount, a DataLoader worker "
        f"deadlocked as it started) or a hung call in the step stalls a process so; {instead}. {tail}"
    )


def process_frozen(what: str, why: str, tail: str) -> str:
    """``what``: a process of this node that is frozen (training/job/node_processes.py)."""
    return (
        f"the job stopped: {what} is frozen (stopped by SIGSTOP, Ctrl-Z or a debugger, with no SIGCONT since): no "
        f"heartbeat, {why}. It was ended with the job. {tail}"
    )


def collective_timeout(error: BaseException, timeout: timedelta, tail: str) -> str:
    return (
        f"{collective_name(error)} waited longer than the collective timeout ({timeout}) and failed, while every "
        "process of the job kept sending its heartbeat: no node was lost, but one process lagged far behind the "
        "others here (a long checkpoint save, a stalled data loader, uneven work; the node logs show which). If "
        f"such waits are expected, raise trainer.strategy.init_args.timeout (now {timeout}) in the config or on the "
        f"command line. {tail}"
    )


def tail(
    lost: str | None,
    progress: tuple[int, int] | None,
    checkpoint: dict[str, Any] | None,
    command: str,
    run: str = "fit",
    nodes: int = 2,
) -> str:
    """Where the job (of ``nodes`` nodes) had got to, its last complete checkpoint and the command that resumes from
    it; for a ``run`` other than fit (validate, test, predict), that it wrote nothing of its end and the command that
    runs it again."""
    again = f"run the same command{' on every node' if nodes > 1 else ''} again"
    back = f"once {lost} is back (or replaced), " if lost else ""
    if run != "fit":
        return (
            f"The {run} stopped before its end, so nothing it writes at its end was written: to {run} from the start, "
            f"{back}{again}{STARTED}{command}"
        )
    reached = f"This node had reached epoch {progress[0]}, step {progress[1]}." if progress else ""
    if checkpoint:
        saved = (
            f"The last complete checkpoint is {checkpoint['path']} (epoch {checkpoint['epoch']}, step "
            f"{checkpoint['step']})."
        )
    else:
        saved = (
            "No checkpoint was completed since this attempt started: resuming uses the run's newest last.ckpt, if any."
        )
    resume = f"To resume from it, {back}{again}{' (only the node rank differs)' if nodes > 1 else ''}"
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        resume = (
            "torchrun restarts the workers from it by itself, up to its --max-restarts, once enough nodes have "
            "joined again (every node, or MIN_NODES of an elastic job, which takes a node back when its launcher is "
            f"started again); if it gives up: {resume[0].lower()}{resume[1:]}"
        )
    return f"{reached} {saved} {resume}{STARTED}{command}".strip()


STARTED = "; this node was started with: "


def with_command(paragraph: str, command: str) -> str:
    """A peer's paragraph, which ends with the command that started the peer's node, with this node's instead."""
    head, found, _ = paragraph.rpartition(STARTED)
    return f"{head}{STARTED}{command}" if found else paragraph
