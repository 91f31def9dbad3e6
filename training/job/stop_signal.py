"""SIGTERM while a job starts: one paragraph and exit status 1, instead of an end without a word (exit -15).

cli.py takes SIGTERM from its first line until the run's checks have passed; from there this handler takes it in
every process of the job until Lightning registers its own, just before training (or validation, testing,
prediction) starts: while Lightning starts the node's other processes, through the start-up handshake, the module's
setup and configure_model hooks and the restore of a checkpoint. Lightning's handler and
training.PreemptionCheckpoint's then stop every rank after the same batch with last.ckpt saved.
"""

import signal
import socket
from typing import Any

from lightning.pytorch import Trainer

from training.job.startup import Stopped
from training.private_api import before_lightning_takes_signals


class StopBeforeTraining:
    """On SIGTERM before ``trainer`` takes it, passes the signal on to the processes Lightning started on this node
    and raises ``Stopped`` in the main thread: cli.py prints it once per node and exits with status 1."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.previous: Any = None

    def start(self, give_back: Any) -> None:
        """Take SIGTERM until ``trainer`` registers its own handler, which then finds ``give_back``; where the run
        happens in processes of the launcher's own (``ddp_spawn``), ``give_back`` takes it at once."""
        taken = before_lightning_takes_signals(self.trainer, self.end)
        self.previous = give_back if taken else None
        signal.signal(signal.SIGTERM, self.stop if taken else give_back)

    def stop(self, signum: int, frame: Any) -> None:
        self.end()  # a second signal is not caught
        if self.trainer.interrupted:  # the run already stops on an error, with its own words: the signal ends it
            signal.raise_signal(signum)
            return
        launcher = self.trainer.strategy.launcher
        if launcher is not None:  # the processes it started on this node
            launcher.kill(signum)
        raise Stopped(
            f"node {self.trainer.node_rank} ({socket.gethostname()}) was stopped by a signal "
            f"({signal.Signals(signum).name}) before training started: nothing was trained and no checkpoint was "
            "written. Run the same command again (on every node) to start the job."
        )

    def end(self) -> None:
        """Give SIGTERM back to the handler it had before."""
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None
