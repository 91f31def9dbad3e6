"""Lightning's progress bar, with the run's id whole."""

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar


class ProgressBar(TQDMProgressBar):
    """Shows ``run=<RUN_ID>`` where Lightning shows ``v_num``, the last four characters of a string version."""

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        if items.pop("v_num", None) is None:
            return items
        return {"run": trainer.logger.version, **items}
