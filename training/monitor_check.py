"""A callback setting that names a metric the model never logs, found after the first step, not an epoch later."""

import difflib

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException


class MonitorCheck(Callback):
    """Stops the run after its first training step when a ``monitor`` names a metric the model does not log, but
    logs one of a close name (``val_loss`` for ``val/loss``).

    ModelCheckpoint, EarlyStopping and LR schedulers look up their ``monitor`` only when they first act, at
    the end of the first epoch, which can be hours in. The names the model logs are known earlier: its
    validation metrics after the sanity check, its step metrics after the first training step. A monitor that
    is neither, nor close to any, may still be logged later (an epoch-level metric), and is left to Lightning.
    """

    def __init__(self) -> None:
        self.validation_metrics: set[str] = set()
        self.checked = False

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.validation_metrics = set(trainer.callback_metrics)  # Lightning clears them once the check is over

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.checked:
            return
        self.checked = True
        logged = self.validation_metrics | set(trainer.callback_metrics)
        monitors = [
            (type(cb).__name__, cb.monitor) for cb in trainer.callbacks if isinstance(getattr(cb, "monitor", None), str)
        ]
        monitors += [("the LR scheduler", config.monitor) for config in trainer.lr_scheduler_configs if config.monitor]
        for who, monitor in monitors:
            close = difflib.get_close_matches(monitor, logged, n=1, cutoff=0.8)
            if monitor not in logged and close:
                raise MisconfigurationException(
                    f"{who} monitors {monitor!r}, which the model does not log; it logs {close[0]!r}. Set "
                    f"monitor: {close[0]} in the config, or log {monitor!r} with self.log in the model. (Found "
                    "after the first training step; Lightning would stop at the end of the first epoch.)"
                )
