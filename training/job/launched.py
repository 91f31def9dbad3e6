"""``python -m training.job.launched PID COMMAND [ARG...]``: run COMMAND so that it receives SIGTERM as soon as process
PID, which starts it, ends, however PID ends: scripts/run_ddp_train.sh starts training through it.

A launcher killed by SIGKILL (the system when memory runs out, ``kill -9``, a crashed session manager) runs no trap:
without this, training would go on under PID 1 with nobody to stop it. SIGTERM makes it save at the next step and
stop every node, as a scheduler's stop does. Linux keeps the parent-death signal through ``exec`` (Lightning's
rank 0 or torchrun are then the process), and the launcher's pid must be checked after asking for it: it may have
ended in between. Standard library only: it runs before every start of training."""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Looked up as this module is imported: a DataLoader worker calls it right after the fork (training/job/forked.py),
# where looking it up would need the dynamic loader's lock, which another thread of its rank may have held at the fork.
PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def signal_when_parent_ends(signum: int) -> None:
    """Have Linux send this process ``signum`` once the thread that started it ends (training/job/forked.py too)."""
    PRCTL(PR_SET_PDEATHSIG, signum)


def main(argv: list[str]) -> None:
    launcher, command = int(argv[0]), argv[1:]
    signal_when_parent_ends(signal.SIGTERM)
    if os.getppid() != launcher:  # the launcher ended before the line above: nobody would stop training
        sys.exit(f"error: the launcher (pid {launcher}) ended before training started; nothing was started.")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
