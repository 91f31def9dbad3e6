"""Lightning's EarlyStopping, for a run that ends when its model is good enough rather than after N epochs."""

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from lightning.pytorch.utilities import rank_zero_info


class StayStopped(EarlyStopping):
    """``EarlyStopping`` that stays stopped: the same command run again after it ended a run trains nothing.

    Lightning restores the callback's state, why it stopped included, with the run, but asks it again only
    after another epoch: a finished run would train one more epoch each time it is run again.
    """

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.stopping_reason != EarlyStoppingReason.NOT_STOPPED:
            rank_zero_info(
                f"training.StayStopped had ended this run: {self.stopping_reason_message} To train it further, "
                f"change its init_args (monitor {self.monitor}) or start a new run with another RUN_ID."
            )
            trainer.should_stop = True
