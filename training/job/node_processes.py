"""The processes of one node that Lightning starts, and what each knows when another of them ends.

The command's own process (local rank 0) starts the node's others and is their parent: it sees at once when one of
them ends, and how; they see at once when it ends. A peer on another node only falls silent
(training/heartbeat/liveness.py).

Lightning's launcher has a watch of its own over the processes it started: up to 5 s after one ended with an error,
it SIGKILLs every process of the node, the one that started them included, before any can say what happened.
``watch`` replaces it (training/private_api.py) and only records who ended; training/strategy.py then stops the job
with one paragraph that names the process. One process speaks for the node (``speaks_for_node``), however many it
has and whichever of them ended.
"""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from training.job.early import STOP_SIGNALS, own_local_rank

# The name torch gives each DataLoader worker's process (/proc/PID/comm; torch/utils/data/_utils/worker.py).
DATA_WORKER = "pt_data_worker"
# The pid of the process that started this one, for the processes Lightning starts (they inherit the environment).
STARTED_BY = "DDP_STARTED_BY"
POLL_SECONDS = 0.2
GRACE_SECONDS = 10.0


class Watch(threading.Thread):
    """Records the first of ``processes`` (local ranks 1, 2, ...) that ends with an error or a signal."""

    def __init__(self, processes: list[subprocess.Popen]) -> None:
        super().__init__(name="node-processes-watch", daemon=True)
        self.processes = processes
        self.ended: tuple[int, subprocess.Popen] | None = None

    def run(self) -> None:
        while self.ended is None:
            running = False
            for local_rank, process in enumerate(list(self.processes), start=1):
                status = process.poll()
                running = running or status is None
                if status:
                    self.ended = (local_rank, process)
                    return
            if not running:  # all ended well
                return
            threading.Event().wait(POLL_SECONDS)


WATCHES: list[Watch] = []


def watch(processes: list[subprocess.Popen]) -> None:
    """What Lightning's launcher calls with the processes it started on this node (training/private_api.py)."""
    started = Watch(processes)
    started.start()
    WATCHES.append(started)


def mark_as_starter() -> None:
    """In a process given no LOCAL_RANK, which starts the node's other processes: they inherit its pid."""
    os.environ[STARTED_BY] = str(os.getpid())


def starter() -> int | None:
    """The pid of the process that started this one, for a process Lightning started; else None."""
    pid = int(os.environ.get(STARTED_BY) or 0)
    return pid if pid not in (0, os.getpid()) else None


def starter_gone() -> bool:
    """Whether the process that started this one has ended (this one was handed to another parent)."""
    pid = starter()
    return pid is not None and os.getppid() != pid


def running() -> dict[int, int]:
    """The local rank and pid of each process that this one's starter started and that still runs. Linux shows each
    process's environment in /proc, none once it ended; a DataLoader worker, forked with its process's environment,
    is told apart by the name torch gives it."""
    started_by = os.environ.get(STARTED_BY)
    found: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*") if started_by else ():
        try:
            items = (entry / "environ").read_bytes().split(b"\0")
            environ = dict(item.split(b"=", 1) for item in items if b"=" in item)
            if environ.get(STARTED_BY.encode()) == started_by.encode() and not is_data_worker(entry):
                found[int(environ[b"LOCAL_RANK"])] = int(entry.name)
        except (OSError, KeyError, ValueError):  # ended meanwhile, or another user's
            continue
    return found


def is_data_worker(proc: Path) -> bool:
    return (proc / "comm").read_text().strip() == DATA_WORKER


def speaks_for_node() -> bool:
    """Whether this process prints its node's paragraph: local rank 0 while it runs, then the lowest local rank still
    running (nobody else would say why the node stopped). Whichever speaks ends the node's later local ranks before it
    ends itself (``let_later_end``, ``end_later``): none is left to speak after it."""
    if not starter_gone():
        return own_local_rank() == 0
    return own_local_rank() <= min(running(), default=own_local_rank())


def later() -> dict[int, int]:
    """The node's processes still running with a local rank above this one's: local rank -> pid. The process that
    started them has them at hand; the others find them in /proc."""
    if starter() is None:
        started = [process for watch in WATCHES for process in watch.processes]
        return {rank: process.pid for rank, process in enumerate(started, start=1) if process.poll() is None}
    return {rank: pid for rank, pid in running().items() if rank > own_local_rank()}


def end_later() -> None:
    """End the node's processes of a later local rank, as this one ends the job: they would only stop later, with no
    more to say. Returns once they are gone (at most GRACE_SECONDS): the command the user started returns after every
    process of its node."""
    for pid in later().values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for_later(GRACE_SECONDS)


def wait_for_later(seconds: float) -> None:
    """Wait up to ``seconds`` until the node's later local ranks are gone (the process that started them reaps them
    here)."""
    deadline = time.monotonic() + seconds
    while later() and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS / 4)


def let_later_end(grace: float = GRACE_SECONDS) -> None:
    """In the process that speaks for its node, as it stops with a paragraph the others meet too (a setting Lightning
    refuses in every process, the end of the process that started them): wait up to ``grace`` seconds for the node's
    later local ranks to end first, silent while this one runs (``speaks_for_node``), then end any still running, so
    that the paragraph is printed once."""
    wait_for_later(grace)
    end_later()


def end_after_error(paragraph: str | None) -> None:
    """At the exit of the process the user started, after its own error's traceback: end the node's later local
    ranks, which would wait for it in a collective and outlive the command, then print ``paragraph`` (the job's
    state, training/heartbeat/why_stopped.py) last."""
    if starter() is not None:  # another local rank: the process that started it ends the node
        return
    end_later()
    if paragraph:
        print(f"\nerror: {paragraph}", file=sys.stderr, flush=True)


def is_frozen(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, Ctrl-Z, a debugger): none of its threads runs, its heartbeat's
    neither."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def end_frozen_starter(grace: float = GRACE_SECONDS) -> None:
    """Kill the process that started this one if it is frozen, and wait up to ``grace`` seconds for it to be gone:
    nobody else would end it, and the command that started it would wait for it forever."""
    pid = starter()
    if pid is None or starter_gone() or not is_frozen(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while not starter_gone() and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)


def how_it_ended(status: int) -> str:
    if status >= 0:
        return f"ended with exit status {status} (its output above says why)"
    name = signal.Signals(-status).name
    if name == "SIGKILL":
        return "was killed by SIGKILL (by someone, or by the system when memory ran out: dmesg says which)"
    return f"was killed by {name}"


class NodeProcesses:
    """What this process knows of the node's other processes: ``where`` names the node (``node 0 (host)``) and
    ``first_rank`` is the global rank of its local rank 0."""

    def __init__(self, where: str, first_rank: int) -> None:
        self.where = where
        self.first_rank = first_rank

    def ended(self, killed_only: bool = False) -> str:
        """Which process this one started has ended, and how; "" if none. With ``killed_only``, only one killed by a
        signal other than a stop request (SIGINT, SIGTERM, SIGHUP: this process has it too): one that exited said why
        itself."""
        for started in WATCHES:
            if started.ended is not None:
                local_rank, process = started.ended
                if not killed_only or (process.returncode < 0 and -process.returncode not in STOP_SIGNALS):
                    rank = self.first_rank + local_rank
                    return (
                        f"rank {rank} (local rank {local_rank}, pid {process.pid}) of {self.where} "
                        f"{how_it_ended(process.returncode)}"
                    )
        return ""

    def frozen(self) -> str:
        """A process of this node that is frozen, named; "" if none."""
        if (started_by := starter()) is None:
            others = later()
        else:
            others = {0: started_by} | {rank: pid for rank, pid in running().items() if pid != os.getpid()}
        for local_rank, pid in sorted(others.items()):
            if is_frozen(pid):
                return f"rank {self.first_rank + local_rank} (local rank {local_rank}, pid {pid}) of {self.where}"
        return ""

    def starter_ended(self) -> str:
        """The process that started this one, if it has ended; "" if not."""
        if not starter_gone():
            return ""
        return (
            f"rank {self.first_rank} (local rank 0, pid {starter()}) of {self.where}, which started this process, "
            "ended (its output above says why, or it was killed)"
        )

    def abandoned(self) -> str:
        """Why a process of a starting job stops waiting for the others: a process of its node ended."""
        if ended := self.ended() or self.starter_ended():
            return (
                f"the job cannot start: {ended} before every process joined. Nothing was trained: run the same "
                "command again (on every node) to start the job."
            )
        return ""
