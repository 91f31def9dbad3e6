"""A callback setting that names a metric the model never logs, found in the first training step, not an epoch later."""

import difflib

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from training.private_api import logged_names

# Hooks that run only at an epoch's end, after the first training step: what they log is not known before. The
# second runs in a run that validates only.
LATE_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end")
# Callbacks of these packages log nothing in those hooks.
QUIET_PACKAGES = ("lightning", "pytorch_lightning", "training")


class MonitorCheck(Callback):
    """Stops the run in its first training step when a ``monitor`` (of ModelCheckpoint, EarlyStopping or an LR
    scheduler) names a metric the model does not log.

    Those look up their ``monitor`` only when they first act, at the end of the first epoch, which can be hours in.
    The names the model logs are known earlier: its validation metrics once the sanity check has validated, what it
    logs in a training step (at step or epoch level) once the first step ran. A monitor that is none of these is
    refused then, with the closest logged name if there is one, else the names logged; where the monitor is the
    run's ``monitor`` setting (``${monitor}`` in configs/ddp.yaml), the paragraph says to set ``--monitor``.

    A model without validation (no ``validation_step``, no val dataloader, or ``limit_val_batches: 0``) cannot have a
    best checkpoint by a metric it does not log in training: a ModelCheckpoint monitoring one keeps none (it would
    look for the metric at every epoch's end and warn), and the run says so once; last.ckpt is kept all the same.

    Two cases stay Lightning's:

    - the module, or a callback from outside Lightning and this template, overrides ``on_train_epoch_end`` or
      ``on_validation_epoch_end``: a name logged there appears only at the end of an epoch (or of a validation,
      which the module may skip in the sanity check), so nothing is refused early;
    - the sanity check validated nothing (``num_sanity_val_steps: 0``): the validation names are not known, so
      only a monitor close to a logged name is refused (``val_loss`` for ``val/loss``).

    Args:
        monitor: the run's ``monitor`` setting, which ``--monitor`` changes.
    """

    def __init__(self, monitor: str | None = None) -> None:
        self.setting = monitor
        self.validation_metrics: set[str] | None = None
        self.checked = False

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if sum(trainer.num_sanity_val_batches) > 0:
            self.validation_metrics = set(trainer.callback_metrics)  # Lightning clears them once the check is over

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.checked:
            return
        self.checked = True
        if late_logging(trainer, pl_module):
            return
        logged = (self.validation_metrics or set()) | logged_names(trainer) | set(trainer.callback_metrics)
        if not validates(trainer, pl_module):
            keep_no_best_checkpoint(trainer, logged)
        for who, monitor in monitors(trainer):
            if monitor in logged | {"epoch", "step"}:  # ModelCheckpoint offers both beside the logged names
                continue
            close = difflib.get_close_matches(monitor, logged, n=1, cutoff=0.8)
            setting = monitor == self.setting and who != "the LR scheduler"
            if close and setting:
                found = f"it logs {close[0]!r}. Set --monitor {close[0]} (monitor: {close[0]} in a config file)"
            elif close:
                found = f"it logs {close[0]!r}. Set monitor: {close[0]} in the config"
            elif self.validation_metrics is not None and setting:
                found = (
                    f"it logs {listed(sorted(logged))}. Set --monitor to one of them (monitor: in a config file; "
                    "--monitor_mode max where higher is better)"
                )
            elif self.validation_metrics is not None:
                found = f"it logs {listed(sorted(logged))}. Set monitor to one of them in the config"
            else:
                continue
            raise MisconfigurationException(
                f"{who} monitors {monitor!r}, which the model does not log; {found}, or log {monitor!r} with "
                "self.log in the model. (Found in the first training step; Lightning would stop at the end of the "
                "first epoch.)"
            )


def monitors(trainer: Trainer) -> list[tuple[str, str]]:
    """(who, metric) for every callback and LR scheduler of ``trainer`` that monitors a metric (a ModelCheckpoint
    that keeps no top-k checkpoint looks up none)."""
    callbacks = [cb for cb in trainer.callbacks if not (isinstance(cb, ModelCheckpoint) and cb.save_top_k == 0)]
    found = [(type(cb).__name__, cb.monitor) for cb in callbacks if isinstance(getattr(cb, "monitor", 0), str)]
    # Lightning reads a scheduler's monitor only for ReduceLROnPlateau.
    schedulers = [config for config in trainer.lr_scheduler_configs if config.monitor and config.reduce_on_plateau]
    return found + [("the LR scheduler", config.monitor) for config in schedulers]


def validates(trainer: Trainer, pl_module: LightningModule) -> bool:
    """Whether the run has a validation: the module's ``validation_step`` and a val dataloader, not limited to 0."""
    source = trainer.datamodule if trainer.datamodule is not None else pl_module
    has_data = is_overridden("val_dataloader", source)
    return trainer.limit_val_batches != 0 and is_overridden("validation_step", pl_module) and has_data


def keep_no_best_checkpoint(trainer: Trainer, logged: set[str]) -> None:
    """Make each ModelCheckpoint of a run without validation whose metric is not logged in training keep no top-k
    checkpoint, and say so."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.monitor and callback.monitor not in logged:
            callback.save_top_k = 0
            rank_zero_info(
                f"The model has no validation (no validation_step, no val dataloader, or limit_val_batches: 0): no "
                f"best checkpoint by {callback.monitor!r}; last.ckpt holds the latest state. For a best checkpoint "
                "by a metric logged in training, set --monitor to it."
            )


def listed(names: list[str], most: int = 12) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(repr(name) for name in names[:most]) + more if names else "nothing"


def late_logging(trainer: Trainer, pl_module: LightningModule) -> bool:
    """Whether the module or a callback may log names at an epoch's end that the first step cannot show. A module
    without validation may override ``on_validation_epoch_end`` all the same (Lightning's GAN example draws samples
    there): in its run that hook never runs."""
    hooks = LATE_HOOKS if validates(trainer, pl_module) else LATE_HOOKS[:1]
    foreign = [cb for cb in trainer.callbacks if type(cb).__module__.split(".")[0] not in QUIET_PACKAGES]
    return any(is_overridden(hook, owner) for hook in hooks for owner in (pl_module, *foreign))
