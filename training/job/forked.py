"""Processes a rank forks through multiprocessing (DataLoader workers, a module's own pools) end with it, however it
ended: a worker stuck in a dataset's ``__getitem__`` never looks at its parent again, and would outlive the job holding
the run's fit.lock, the node log's pipe and, on a GPU machine, memory. Linux ends such a child when the thread that
forked it ends: Lightning iterates its loaders in the main thread.

A DataLoader worker leaves the stop signals to its rank. A signal to every process of the job (``kill -TERM -PGID``,
GNU ``timeout``, Slurm at a time limit, systemd) reaches the workers too; torch's worker dies of a SIGTERM from
anyone but its rank, and the rank, one batch short, would fail with "DataLoader worker (pid N) is killed by signal"
instead of saving at the next step. A SIGTERM from the rank itself still ends the worker at once: torch and
multiprocessing end workers that way (at the rank's exit, it waits for them). A pool of the module's own keeps the
signals' usual effect: ``Pool.terminate`` ends its workers with SIGTERM. A worker also tells its rank where it is,
when the rank asks for a stall report (training/heartbeat/worker_stacks.py)."""

import contextlib
import multiprocessing
import multiprocessing.util
import os
import signal
import threading

from training.heartbeat import worker_stacks
from training.job.early import STOP_SIGNALS
from training.job.launched import signal_when_parent_ends
from training.private_api import is_data_loader_worker


def end_with_parent(_: object) -> None:
    """In a child multiprocessing has just forked: SIGKILL once the parent ends; a DataLoader worker blocks the stop
    signals (the processes it starts inherit that)."""
    signal_when_parent_ends(signal.SIGKILL)
    if is_data_loader_worker(multiprocessing.current_process()):
        signal.pthread_sigmask(signal.SIG_BLOCK, (*STOP_SIGNALS, signal.SIGUSR1, worker_stacks.ASK))
        threading.Thread(target=answer_parent, name="signals-from-rank", daemon=True).start()
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the parent ended before the line above
        os._exit(1)


def answer_parent() -> None:
    """In a worker whose SIGTERM is blocked: end it on one its parent sent, as torch's own handler does; write its stack
    when the parent asks for it (training/heartbeat/worker_stacks.py); drop signals from anyone else."""
    while True:
        received = signal.sigwaitinfo({signal.SIGTERM, worker_stacks.ASK})
        if received.si_pid != os.getppid():
            continue
        if received.si_signo == signal.SIGTERM:
            os._exit(0)
        worker_stacks.answer()


class Registration:
    """multiprocessing keeps the object it calls ``end_with_parent`` for by a weak reference: this module holds it."""

    registered = False


REGISTRATION = Registration()


def end_forked_with_this_process() -> None:
    """From now on, every process that multiprocessing forks from this one is killed (SIGKILL) when this one ends, and
    its DataLoader workers answer when asked for their stacks."""
    multiprocessing.util.register_after_fork(REGISTRATION, end_with_parent)
    REGISTRATION.registered = True


def exit_at_once(status: int) -> None:
    """End this process now (``os._exit``), SIGKILLing every process multiprocessing forked from it first: those that
    ran ``end_with_parent`` would get it as this one ends anyway; one that hung in its fork before it
    (docs/versions.md) never did, takes no SIGTERM, and would outlive it."""
    for child in multiprocessing.active_children():
        with contextlib.suppress(OSError):
            child.kill()
    os._exit(status)
