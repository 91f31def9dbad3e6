"""Where a run keeps its checkpoints, and what a resumed run says about where it continues.

The resume itself is Lightning's: ``ckpt_path: last`` in configs/ddp.yaml loads the newest ``last*.ckpt`` of
the run's checkpoint directory, and a run without one starts from scratch.
"""

from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info


def checkpoint_dir(trainer: Trainer) -> Path | None:
    """The directory ``trainer.checkpoint_callback`` writes to, resolved as ModelCheckpoint does in its setup."""
    callback = trainer.checkpoint_callback
    if not isinstance(callback, ModelCheckpoint):
        return None
    if callback.dirpath:
        return Path(callback.dirpath)
    if not trainer.loggers:
        return Path(trainer.default_root_dir) / "checkpoints"
    logger = trainer.loggers[0]
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return Path(logger.save_dir or trainer.default_root_dir) / str(logger.name) / version / "checkpoints"


def last_checkpoint_path(trainer: Trainer) -> Path:
    """Where the run's ``last.ckpt`` is written (or was, by an earlier run with the same id)."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.last_model_path:
        return Path(callback.last_model_path)
    return checkpoint_dir(trainer) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"


class ResumeReport(Callback):
    """Says where a resumed run continues, and that there is nothing to train when it had already ended."""

    def __init__(self) -> None:
        self.resumed_step: int | None = None

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self.resumed_step = checkpoint["global_step"]
        rank_zero_info(f"Resuming from {trainer.ckpt_path} (epoch {checkpoint['epoch']}, step {self.resumed_step}).")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.resumed_step == trainer.global_step:
            # Without a ModelCheckpoint, the run is where its checkpoint came from.
            run = (checkpoint_dir(trainer) or Path(trainer.ckpt_path)).parent
            rank_zero_info(
                f"Nothing to train: the run in {run} already reached its end (epoch "
                f"{trainer.current_epoch}, step {trainer.global_step}; trainer.max_epochs={trainer.max_epochs}, "
                f"trainer.max_steps={trainer.max_steps}). Raise those to train longer, or set RUN_ID to start a new "
                "run."
            )
        self.resumed_step = None
