"""One training at a time per run: a second copy of a run is refused before it trains."""

import fcntl
import json
import os
import socket
import time
from datetime import datetime
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

from training.job.startup import StartupError
from training.run.record import run_directory
from training.run.storage import is_remote

LOCK_NAME = "fit.lock"
# A holder that died leaves the lock to the processes it forked (DataLoader workers) until they notice, in seconds.
ORPHAN_GRACE = 60.0


class LockFile:
    """An exclusive lock on ``path`` that dies with the process holding it (``flock``), which writes who it is
    (pid, host, since when) into the file and removes the file when it lets go.

    A crashed holder leaves the file but not the lock: the next process takes it and writes itself in. Processes
    the holder forked (DataLoader workers) share its lock until they notice it died: a holder of this host that is
    gone is waited for up to ORPHAN_GRACE seconds.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> dict | None:
        """Take the lock; return None, or what the process holding it wrote (empty while it is being written)."""
        deadline = time.monotonic() + ORPHAN_GRACE
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = read_holder(fd) | {"holders": holders(self.path)}
                os.close(fd)
                if not orphaned(holder) or time.monotonic() > deadline:
                    return holder
                time.sleep(0.5)
                continue
            # The holder before removes the file before it unlocks: a lock on a removed file is no lock.
            try:
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": datetime.now().isoformat(" ", "seconds")}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(me).encode())
        self.fd = fd
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)
        fcntl.flock(self.fd, fcntl.LOCK_UN)  # DataLoader workers forked from this process share the lock
        os.close(self.fd)
        self.fd = None


def read_holder(fd: int) -> dict:
    try:
        return json.loads(os.read(fd, 4096).decode(errors="replace"))
    except ValueError:
        return {}


def holders(path: Path) -> list[int]:
    """The processes of this host, other than this one, that have ``path`` open: whoever holds its lock is among
    them, a process forked from the one that wrote itself in included."""
    target = str(path.resolve())
    found = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == target and int(fd.parts[2]) != os.getpid():
                found.append(int(fd.parts[2]))
        except (OSError, ValueError):  # ended meanwhile, or another user's
            continue
    return sorted(set(found))


def orphaned(holder: dict) -> bool:
    """Whether ``holder`` is a process of this host that is gone."""
    if holder.get("host") != socket.gethostname() or not holder.get("pid"):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class RunLock(Callback):
    """Holds the run's ``fit.lock`` while ``fit`` runs, so two copies of one run (the same ``logs/<name>/<RUN_ID>``)
    never train into one directory: the second stops before it trains, on every node, naming the process that holds
    the run. Only global rank 0 takes the lock, once the job's processes have joined; a process that dies lets go of
    it, so a crashed run never blocks the next attempt, and a requeued or restarted job takes it again.
    """

    def __init__(self) -> None:
        self.lock: LockFile | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        run = run_directory(trainer)  # a broadcast: every rank takes part
        if run is None or is_remote(run):  # fast_dev_run writes nothing; an object store has no lock to take
            return
        run = Path(run)
        holder = None
        if trainer.is_global_zero:
            run.mkdir(parents=True, exist_ok=True)
            self.lock = LockFile(run / LOCK_NAME)
            holder = self.lock.acquire()
            if holder is not None:
                self.lock = None
        holder = trainer.strategy.broadcast(holder)
        if holder is not None:
            raise StartupError(refusal(run, holder))

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def refusal(run: Path, holder: dict) -> str:
    """The paragraph that stops a second copy of the run in ``run``, held by ``holder`` (pid, host, since)."""
    who = "another process"
    if holder.get("pid"):
        who = f"another process (pid {holder['pid']} on {holder.get('host', '?')}, since {holder.get('since', '?')})"
    stop = f"stop it (kill {holder['pid']} on {holder.get('host', '?')})" if holder.get("pid") else "stop it"
    # The one that wrote itself in has ended; processes it forked hold the lock on (DataLoader workers that hang).
    if holder.get("holders") and holder.get("pid") not in holder["holders"]:
        pids = " ".join(map(str, holder["holders"]))
        who = f"pid {pids} on {holder.get('host', '?')} (forked by pid {holder.get('pid')}, which has ended)"
        stop = f"stop it (kill {pids} on {holder.get('host', '?')})"
    return (
        f"the run in {run.resolve()} is already training: {who} holds its {LOCK_NAME}. Two copies of one run would "
        f"write the same checkpoints and curves. Wait for it to end, {stop}, or start this one as another run with "
        "RUN_ID=<new id>. This attempt changed nothing."
    )
