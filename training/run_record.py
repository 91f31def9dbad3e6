"""The run's ``config.yaml``: written by the attempt that trains, never by one that fails before it does."""

import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from training.fingerprint import config_items
from training.mlflow_logger import MLFlowLogger

PER_NODE = ("num_nodes", "devices")  # left out of config_items, which the nodes compare


class RunRecord(SaveConfigCallback):
    """Saves the config of ``fit`` when the run first saves a checkpoint (or ends training without one).

    So ``config.yaml`` always describes the training that wrote the run's ``last.ckpt``: an attempt that stops
    before it trains (a wrong setting, a run already past its end) leaves the record as it was. When the
    config changed since the record was written, the earlier one is kept as ``config-<time it was written>.yaml``.
    Such an attempt also takes back the empty TensorBoard file Lightning opens at set-up. validate/test/predict
    save their own ``<subcommand>-config.yaml`` at start, as Lightning does.
    """

    log_dir: str | None = None
    started_at: int | None = None  # the step training started from, once it has

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            super().setup(trainer, pl_module, stage)
        elif not self.already_saved:
            self.log_dir = trainer.log_dir  # a broadcast: read here, where every rank takes part

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.started_at = trainer.global_step
        if trainer.is_global_zero:
            settings = self.config.as_dict()
            items = {**config_items(settings), **{f"trainer.{key}": str(settings["trainer"][key]) for key in PER_NODE}}
            for logger in trainer.loggers:
                if isinstance(logger, MLFlowLogger):  # the config as the tracker's parameters
                    logger.log_config(items)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self.write(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.trained(trainer):
            self.write(trainer)

    def trained(self, trainer: Trainer) -> bool:
        return self.started_at is not None and trainer.global_step > self.started_at

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.take_back(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.take_back(trainer)  # a rerun of a finished run ends here without training, and without an exception

    def take_back(self, trainer: Trainer) -> None:
        """Removes the TensorBoard file this attempt opened when it holds nothing, and the run's directory when
        that leaves it empty: an attempt that did not train leaves the run's directory as it found it."""
        if self.already_saved or self.trained(trainer) or not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if not isinstance(logger, TensorBoardLogger) or not os.path.isdir(logger.log_dir):
                continue
            logger.experiment.close()
            mine = re.compile(rf"events\.out\.tfevents\..*\.{os.getpid()}\.\d+")  # its name ends in pid.counter
            for path in Path(logger.log_dir).iterdir():
                if mine.fullmatch(path.name) and len(list(EventFileLoader(str(path)).Load())) <= 1:  # the header
                    path.unlink()
            if not any(Path(logger.log_dir).iterdir()):
                Path(logger.log_dir).rmdir()

    def write(self, trainer: Trainer) -> None:
        if self.already_saved or self.log_dir is None:
            return
        self.already_saved = True
        if not trainer.is_global_zero:
            return
        fs = get_filesystem(self.log_dir)
        path = f"{self.log_dir.rstrip('/')}/{self.config_filename}"
        text = self.parser.dump(self.config, skip_none=False)
        if fs.isfile(path):
            with fs.open(path) as file:
                earlier = file.read().decode()
            if earlier == text:
                return
            written = datetime.fromtimestamp(fs.modified(path).timestamp()).strftime("%Y%m%d-%H%M%S")
            fs.mv(path, path.removesuffix(".yaml") + f"-{written}.yaml")
        fs.makedirs(self.log_dir, exist_ok=True)
        with fs.open(f"{path}.partial", "w") as file:
            file.write(text)
        fs.mv(f"{path}.partial", path)
        self.save_config(trainer, trainer.lightning_module, "fit")
