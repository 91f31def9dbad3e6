"""SIGTERM while a job starts: one paragraph and exit status 1, instead of an end without a word (exit -15).

From the start-up handshake until training starts, when Lightning's handler and training.PreemptionCheckpoint's
take over (they stop every rank after the same batch with last.ckpt saved).
"""

import signal
import threading
from collections.abc import Callable
from typing import Any

from training.job.startup import Stopped


class StopBeforeTraining:
    """Raises ``Stopped`` in the main thread on SIGTERM, after passing the signal on with ``pass_on`` (the processes
    Lightning started on this node); ``where`` names this node."""

    def __init__(self) -> None:
        self.previous: Any = None

    def start(self, where: Callable[[], str], pass_on: Callable[[int], None]) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum: int, frame: Any) -> None:
            self.end()  # a second signal is not caught
            pass_on(signum)
            raise Stopped(
                f"{where()} was stopped by a signal ({signal.Signals(signum).name}) before training started: nothing "
                "was trained and no checkpoint was written. Run the same command again (on every node) to start "
                "the job."
            )

        self.previous = signal.signal(signal.SIGTERM, stop)

    def end(self) -> None:
        """Give SIGTERM back to the handler it had before."""
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None
