"""Lightning's EarlyStopping, for a run that ends when its model is good enough rather than after N epochs."""

from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.utilities import rank_zero_info


class StayStopped(EarlyStopping):
    """``EarlyStopping`` that stays stopped: the same command run again after it ended a run trains nothing.

    Lightning restores the callback's state with the run, but asks it again only after another epoch: a finished
    run would train one more epoch each time it is run again. Why it stopped is kept in the callback's own state:
    Lightning 2.5 keeps none.
    """

    ended: str | None = None  # why this callback ended the run

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.ended:
            rank_zero_info(
                f"training.StayStopped had ended this run: {self.ended} To train it further, "
                f"change its init_args (monitor {self.monitor}) or start a new run with another RUN_ID."
            )
            trainer.should_stop = True

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.note_stop(super().on_validation_end, trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.note_stop(super().on_train_epoch_end, trainer, pl_module)

    def note_stop(self, check: Callable[[Trainer, LightningModule], None], trainer: Trainer, module: Any) -> None:
        stopping = trainer.should_stop
        check(trainer, module)
        if trainer.should_stop and not stopping:  # this check stopped it; Lightning 2.6 also says why
            best = f"{self.monitor} = {self.best_score.item():.6g} at best"
            self.ended = getattr(self, "stopping_reason_message", None) or f"{best}, in epoch {trainer.current_epoch}."

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"ended": self.ended}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.ended = state_dict.get("ended", state_dict.get("stopping_reason_message"))  # or as saved before
