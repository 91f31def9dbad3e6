"""A stop while cli.py starts, before anything of the run exists: one paragraph instead of a traceback from the middle
of an import. Standard library only: it is taken before torch and Lightning are imported, which takes seconds."""

import contextlib
import os
import signal
import socket
import sys

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def own_local_rank() -> int:
    # srun starts every process of a node itself and gives each SLURM_LOCALID, not LOCAL_RANK.
    return int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or 0)


def stopped_while_starting(signum: int, frame: object) -> None:
    if own_local_rank() == 0:  # the first process of a node speaks for it
        subcommand = sys.argv[1] if sys.argv[1:2] in (["validate"], ["test"], ["predict"]) else None
        before = (
            f"before its {subcommand} ran: nothing was written. Run the same command again to start the {subcommand}."
            if subcommand
            else "before training: nothing was trained and no checkpoint was written. Run the same command again to "
            "start the job."
        )
        with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) takes no more output
            print(
                f"\nerror: cli.py on {socket.gethostname()} was stopped by a signal ({signal.Signals(signum).name}) "
                f"while it started, {before}",
                file=sys.stderr,
            )
    # Not sys.exit: raised at whatever line the import runs, a bare ``except:`` of a library's optional import would
    # swallow it, and the run would go on to train. Nothing of the run exists yet that an exit must clean up.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(1)


def not_ignored(signals: tuple[int, ...] = STOP_SIGNALS) -> list[int]:
    """The signals of ``signals`` this process may take: a signal ignored when the process started stays ignored
    (nohup's SIGHUP, a script's background SIGINT)."""
    return [signum for signum in signals if signal.getsignal(signum) is not signal.SIG_IGN]


def take_stop_signals() -> None:
    """Stop with the paragraph on SIGTERM, Ctrl-C and SIGHUP, until training/job/stop_signal.py takes them."""
    for signum in not_ignored():
        signal.signal(signum, stopped_while_starting)


def taken() -> bool:
    """Whether this process took the stop signals at its start (cli.py run as a script, not a test's call)."""
    return signal.getsignal(signal.SIGTERM) is stopped_while_starting
