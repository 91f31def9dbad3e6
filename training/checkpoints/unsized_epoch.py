"""A run resumed part-way through an epoch of training data without a length and without a saved position."""

from collections.abc import Iterable
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

UNKNOWN = float("inf")  # Lightning's number of batches of a loader without a length


def loaders(iterables: Any) -> Iterable[Any]:
    """The loaders of ``trainer.train_dataloader``: one, or those of a dict, list or tuple of them."""
    if isinstance(iterables, dict):
        iterables = list(iterables.values())
    if isinstance(iterables, list | tuple):
        for iterable in iterables:
            yield from loaders(iterable)
    elif iterables is not None:
        yield iterables


def keeps_position(loader: Any) -> bool:
    """Whether Lightning saves the loader's place in the epoch and gives it back on resume (torchdata's
    StatefulDataLoader, the template's streaming and resumable loaders)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class UnsizedEpochResume(Callback):
    """Keeps a resumed run's step count right when its training data cannot continue part-way through an epoch.

    A loader of an ``IterableDataset`` without ``__len__`` and without a ``state_dict`` starts its epoch again from
    the first batch on resume, while Lightning 2.6.6 goes on counting the epoch's batches from where the checkpoint
    was saved, says nothing, and ends the epoch when the data runs out: the run trains as many batches more than an
    uninterrupted one as the checkpoint's epoch had done. This callback saves in each checkpoint how many batches the
    last whole epoch had; a run resumed part-way through an epoch ends that epoch after the batches it had left by
    that count, so it ends at the step an uninterrupted run would, and says so in one line. The epoch's first
    batches are seen again and its last ones not. Before a first whole epoch the length is unknown: the line says
    how many batches more the run trains. Loaders of known length are Lightning's to resume, and it warns where they
    cannot.
    """

    def __init__(self) -> None:
        self.epoch_batches: int | None = None  # of the last whole epoch of data without a length
        self.cap: int | None = None  # the resumed epoch's length, once its first batch is under way
        self.capped_validation = False

    def state_dict(self) -> dict[str, Any]:
        return {"epoch_batches": self.epoch_batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch_batches = state_dict["epoch_batches"]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        fit_loop = trainer.fit_loop
        if not fit_loop.restarted_mid_epoch or trainer.num_training_batches != UNKNOWN:
            return
        if all(keeps_position(loader) for loader in loaders(trainer.train_dataloader)):
            return
        done = fit_loop.epoch_loop.batch_progress.current.processed
        start = (
            f"Epoch {trainer.current_epoch} starts again from its first batch: the training data (an IterableDataset "
            "without a length, in a loader without state_dict) cannot continue part-way through an epoch"
        )
        fix = (
            "A loader with state_dict and load_state_dict continues where it stopped (data/resumable.py's "
            "EpochPosition keeps the trainer's count)."
        )
        if self.epoch_batches is None or done >= self.epoch_batches:
            rank_zero_info(
                f"{start}, and its length is not known (no earlier epoch of it ended), so this run trains {done} "
                f"batches more than an uninterrupted one would. {fix}"
            )
            return
        self.cap = self.epoch_batches
        rank_zero_info(
            f"{start}. It ends after the {self.epoch_batches - done} batches it had left (the previous epoch had "
            f"{self.epoch_batches}), so the run ends at the step an uninterrupted one would. {fix}"
        )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # Not before: Lightning would take the epoch for one of known length that cannot resume, and warn so.
        if self.cap is None or trainer.num_training_batches != UNKNOWN:
            return
        trainer.fit_loop.max_batches = self.cap
        if trainer.val_check_batch == UNKNOWN:  # validation at the epoch's end, which is now the cut
            trainer.val_check_batch = self.cap
            self.capped_validation = True

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.cap is not None:
            trainer.fit_loop.max_batches = UNKNOWN
            if self.capped_validation:
                trainer.val_check_batch = UNKNOWN
            self.cap, self.capped_validation = None, False
        elif trainer.num_training_batches == UNKNOWN:
            self.epoch_batches = trainer.fit_loop.epoch_loop.batch_progress.current.ready
