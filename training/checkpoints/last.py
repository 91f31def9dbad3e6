"""The run's last.ckpt: its latest state, whatever the monitored metric does."""

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from training.private_api import last_saved_step


class LastCheckpoint(ModelCheckpoint):
    """Keeps one checkpoint, ``last.ckpt``, the run's latest state: the same command resumes from it.

    Lightning 2.6.6's ``save_last`` writes ``last.ckpt`` only in a step where the same callback saved a top-k
    checkpoint: beside a best checkpoint by a metric that stopped improving, it stays at the last improvement. This
    is Lightning's ModelCheckpoint without a monitor, keeping one file named ``last``, written at every epoch's end
    (and after each validation where one runs several times an epoch), every ``every_n_train_steps`` optimizer steps
    if set, and at the end of training, each time unless it holds that step already. training.PreemptionCheckpoint
    writes it on a stop signal. The best checkpoint by the monitored metric is another ModelCheckpoint's, with a
    top-k rule of its own; this one comes after it in the callbacks, so that last.ckpt holds which one is best.

    Args:
        every_n_train_steps: write it every N optimizer steps as well.
    """

    def __init__(self, every_n_train_steps: int | None = None) -> None:
        super().__init__(
            filename=self.CHECKPOINT_NAME_LAST,
            save_top_k=1,
            enable_version_counter=False,  # last.ckpt is written over, never beside as last-v1.ckpt
            every_n_train_steps=every_n_train_steps,
        )
        self.start_step = self.saved_step = 0

    @property
    def last_model_path(self) -> str:
        # Lightning keeps the one checkpoint of a callback without a monitor as its best.
        return self.best_model_path

    @last_model_path.setter
    def last_model_path(self, path: str) -> None:
        self.best_model_path = path

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.start_step = trainer.global_step

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning's own trigger writes at an epoch's end only without every_n_train_steps, and with
        # check_val_every_n_epoch > 1 only after the epochs that validate.
        super().on_train_epoch_end(trainer, pl_module)
        self.write_unless_current(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.write_unless_current(trainer)

    def write_unless_current(self, trainer: Trainer) -> None:
        """Write last.ckpt unless it holds this step, or the run trained nothing (resumed at its end)."""
        if trainer.fast_dev_run or trainer.global_step in (self.start_step, self.saved_step, last_saved_step(self)):
            return
        self.saved_step = trainer.global_step
        self.best_model_path = self.format_checkpoint_name({})  # before the save: the state saved holds it
        trainer.save_checkpoint(self.best_model_path)
