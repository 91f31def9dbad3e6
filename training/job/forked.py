"""Processes a rank forks through multiprocessing (DataLoader workers, a module's own pools) end with it, however it
ended: a worker stuck in a dataset's ``__getitem__`` never looks at its parent again, and would outlive the job holding
the run's fit.lock, the node log's pipe and, on a GPU machine, memory. Linux ends such a child when the thread that
forked it ends: Lightning iterates its loaders in the main thread."""

import ctypes
import multiprocessing
import multiprocessing.util
import os
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent(_: object) -> None:
    """In a child multiprocessing has just forked: SIGKILL once the parent ends."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the parent ended before the line above
        os._exit(1)


class Registration:
    """multiprocessing keeps the object it calls ``end_with_parent`` for by a weak reference: this module holds it."""


REGISTRATION = Registration()


def end_forked_with_this_process() -> None:
    """From now on, every process that multiprocessing forks from this one is killed (SIGKILL) when this one ends."""
    multiprocessing.util.register_after_fork(REGISTRATION, end_with_parent)
