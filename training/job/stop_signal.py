"""Stop requests: SIGTERM, Ctrl-C (SIGINT), a closed terminal (SIGHUP) and SLURM's SIGUSR1, one mechanism for every
phase of a run.

cli.py takes SIGTERM, SIGINT and SIGHUP from its first line until its checks have passed. From there ``REQUESTS``
takes them in every process of the job:

- until training starts (while Lightning starts the node's other processes, through the start-up handshake, the
  module's setup and configure_model hooks, the restore of a checkpoint and the sanity check), and through a whole
  validate, test or predict: the processes Lightning started on the node get the signal too, and cli.py prints
  ``Stopped`` once per node and exits with status 1. Lightning takes SIGTERM alone just before the sanity check.
- while training runs (training.PreemptionCheckpoint arms it): the request is only noted, and PreemptionCheckpoint
  stops every rank after the same batch with last.ckpt saved. A second Ctrl-C stops at once, as without the template.
- once training has ended: a request noted since the ranks last agreed (in the last validation) gets one line, and
  so does a Ctrl-C: the run ends as it would have, and a second Ctrl-C stops it at once. SIGTERM and SIGHUP do what
  they do without the template.

A signal ignored when the process started stays ignored: ``nohup`` keeps a run going after its terminal closes.
"""

import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn

from training.job.early import not_ignored
from training.job.forked import exit_at_once
from training.job.node_processes import speaks_for_node
from training.job.startup import Stopped
from training.private_api import before_lightning_takes_signals

# After the save: a scheduler's stop (SIGTERM, SLURM's SIGUSR1) ends well, so a requeued job is no failed one; a
# person's stop ends as a shell reports a stopped command.
EXIT_STATUS = {
    signal.SIGUSR1: 0,
    signal.SIGTERM: 0,
    signal.SIGHUP: 128 + signal.SIGHUP,
    signal.SIGINT: 128 + signal.SIGINT,
}
# When the ranks heard different signals, the last of these names the stop.
URGENCY = (None, signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
CAUSE = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGHUP: "its terminal closing (SIGHUP)"}
RESUME = "Run the same command again to resume from the run's last checkpoint."
# Where a process's output goes once its terminal has closed, unless the launcher gave it a node log.
NODE_LOG = "logs/nodes/node{node_rank}.log"


def cause(signum: int) -> str:
    return CAUSE.get(signum, f"a signal ({signal.Signals(signum).name})")


def default_handler(signum: int) -> Any:
    """Python's own handler for ``signum``: Ctrl-C raises KeyboardInterrupt, the others end the process."""
    return signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL


def leave_closed_terminal() -> None:
    """Send this process's output to the node's log: a write to a closed terminal fails, and would end training with
    an error instead of the save."""
    path = Path(os.environ.get("DDP_NODE_LOG") or NODE_LOG.format(node_rank=os.environ.get("NODE_RANK", "0")))
    path.parent.mkdir(parents=True, exist_ok=True)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)


class StopRequests:
    """The stop requests of this process, from cli.py's checks to the end of training."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.pid = os.getpid()
        self.training = self.ended = False
        self.received: int | None = None  # the most urgent signal while training
        self.stopping = False  # stopped before training
        self.interrupts = 0
        # Asked now: once the terminal has closed, it is no terminal any more.
        self.on_terminal = any(os.isatty(fd) for fd in (1, 2))

    def start(self, trainer: Trainer) -> None:
        """Take the stop signals for ``trainer``'s run, SIGTERM until Lightning registers its own handler, which then
        finds the default; where the run happens in processes of the launcher's own (``ddp_spawn``), each signal gets
        its default at once."""
        self.trainer = trainer
        if not before_lightning_takes_signals(trainer, lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)):
            for signum in not_ignored():
                signal.signal(signum, default_handler(signum))
            return
        for signum in not_ignored():
            signal.signal(signum, self.handle)

    def arm(self, trainer: Trainer, noted: int | None) -> None:
        """From ``trainer``'s start of training, with the request ``noted`` since the sanity check: only note
        requests."""
        self.trainer, self.pid, self.training, self.ended = trainer, os.getpid(), True, False
        self.interrupts, self.received = 0, noted

    def disarm(self) -> None:
        """At training's end: each signal does what it does without the template, but Ctrl-C (``after_end``)."""
        self.training, self.ended = False, True
        if self.received is not None:  # the ranks agree only after training batches: none came after it
            self.acknowledge(self.received, "during the last validation")

    def acknowledge(self, signum: int, when: str) -> None:
        if speaks_for_node():
            print(
                f"\n{cause(signum)} arrived {when}: training had finished, and the run ends as it would have. "
                "A second Ctrl-C stops it at once.",
                file=sys.__stderr__,
                flush=True,
            )

    def after_end(self, signum: int) -> None:
        """A Ctrl-C once training has ended: one line, then a second stops at once; not a KeyboardInterrupt raised
        in whatever the process does at its end (teardown, an atexit callback)."""
        self.interrupts += 1
        if self.interrupts > 1:
            self.stop_at_once()
        self.acknowledge(signum, "as training ended")

    def handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.pid:  # a DataLoader worker forked from this process: its rank stops it
            return
        if self.stopping:  # a stop before training is under way: a local rank gets a group's signal and rank 0's
            return
        if signum == signal.SIGHUP and self.on_terminal:
            leave_closed_terminal()
            self.on_terminal = False
        if self.training:
            self.note(signum)
        elif self.ended and signum == signal.SIGINT:
            self.after_end(signum)
        elif self.ended or self.trainer.interrupted:
            # Training has ended, or the run stops on an error with its own words: the signal's own effect.
            signal.signal(signum, default_handler(signum))
            signal.raise_signal(signum)
        else:
            self.stop(signum)

    def note(self, signum: int) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                self.stop_at_once()
        if self.received is None and self.trainer.strategy.launcher is not None:
            self.trainer.strategy.launcher.kill(signal.SIGTERM)  # the processes it started on this node
        if URGENCY.index(signum) > URGENCY.index(self.received):
            self.received = signum

    def stop_at_once(self) -> None:
        """A second Ctrl-C: end this process and those it started now, in whatever they do; a checkpoint being
        written stays a temporary file beside the previous one (training.AtomicCheckpointIO)."""
        launcher = self.trainer.strategy.launcher
        if launcher is not None:
            launcher.kill(signal.SIGKILL)
        if speaks_for_node():
            print(
                f"\nerror: stopped at once by a second Ctrl-C: nothing more was saved. {RESUME}",
                file=sys.__stderr__,
                flush=True,
            )
        exit_at_once(EXIT_STATUS[signal.SIGINT])

    def stop(self, signum: int) -> None:
        # Any later signal changes nothing: Lightning's teardown gives the signals back the handlers they had when
        # it started, this one's among them, and a second signal then raised in the middle of the stop's own words.
        self.stopping = True
        launcher = self.trainer.strategy.launcher
        if launcher is not None:  # the processes it started on this node
            launcher.kill(signum)
        node = f"node {self.trainer.node_rank} ({socket.gethostname()})"
        doing = self.trainer.state.fn
        if doing == TrainerFn.FITTING:
            raise Stopped(
                f"{node} was stopped by {cause(signum)} before training started: nothing was trained and no checkpoint "
                "was written. Run the same command again (on every node) to start the job."
            )
        raise Stopped(  # validate, test or predict: what they write comes at their end
            f"{node} was stopped by {cause(signum)} before {doing.value} ended: it wrote no "
            f"{'predictions' if doing == TrainerFn.PREDICTING else 'metrics'}, and the run's checkpoints are as they "
            f"were. Run the same command again (on every node) to {doing.value}."
        )


REQUESTS = StopRequests()
