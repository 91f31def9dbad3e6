"""The run's last.ckpt: its latest state, whatever the monitored metric does."""

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from training.private_api import last_saved_step


class LastCheckpoint(ModelCheckpoint):
    """Keeps one checkpoint, ``last.ckpt``, the run's latest state: the same command resumes from it.

    Lightning 2.6.6's ``save_last`` writes ``last.ckpt`` only in a step where the same callback saved a top-k
    checkpoint: beside a best checkpoint by a metric that stopped improving, it stays at the last improvement. This
    is Lightning's ModelCheckpoint without a monitor, keeping one file named ``last``: written at every epoch's end
    (after each validation where one runs several times an epoch), or every ``every_n_train_steps`` optimizer steps,
    and at the end of training when the last write was earlier. training.PreemptionCheckpoint writes it on a stop
    signal. The best checkpoint by the monitored metric is another ModelCheckpoint's, with a top-k rule of its own.

    Args:
        every_n_train_steps: write it every N optimizer steps instead of at every epoch's end.
    """

    def __init__(self, every_n_train_steps: int | None = None) -> None:
        super().__init__(
            filename=self.CHECKPOINT_NAME_LAST,
            save_top_k=1,
            enable_version_counter=False,  # last.ckpt is written over, never beside as last-v1.ckpt
            every_n_train_steps=every_n_train_steps,
        )
        self.start_step = 0

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

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The steps after the last multiple of every_n_train_steps; at an epoch's end the write was at this step, and
        # a run that trained nothing (resumed at its end) has its checkpoint already.
        if trainer.fast_dev_run or trainer.global_step in (self.start_step, last_saved_step(self)):
            return
        self.best_model_path = self.format_checkpoint_name({})  # the state saved holds it
        trainer.save_checkpoint(self.best_model_path)
