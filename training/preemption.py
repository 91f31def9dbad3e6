"""Save the run's last checkpoint when the job is told to stop (SIGTERM, or SIGUSR1 from SLURM), then exit 0."""

import os
import signal
import threading
from types import FrameType

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from training.resume import last_checkpoint_path


def _as_sigterm(signum: int, frame: FrameType | None) -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class PreemptionCheckpoint(Callback):
    """Writes ``last.ckpt`` at the batch where a stop signal arrived, so the same command resumes from there.

    On SIGTERM, Lightning lets every rank finish its current batch, then raises ``SIGTERMException`` on all
    of them together; this callback saves the checkpoint at that point and the process exits with status 0.
    SIGUSR1, which SLURM sends ahead of a time limit or preemption (``#SBATCH --signal``), is handled the same
    way; taking it over also keeps Lightning's own SLURM handler from writing a second checkpoint elsewhere.
    """

    def __init__(self) -> None:
        self._previous_handler: signal.Handlers | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGUSR1, _as_sigterm)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGUSR1, self._previous_handler)
            self._previous_handler = None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.checkpoint_callback is None:
            return
        path = last_checkpoint_path(trainer)
        trainer.checkpoint_callback.last_model_path = str(path)
        trainer.save_checkpoint(path, weights_only=False)
        rank_zero_info(
            f"Stopped by a signal at epoch {trainer.current_epoch}, step {trainer.global_step}: saved {path}. "
            "Run the same command again to resume from there."
        )
