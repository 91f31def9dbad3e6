"""The run's ``config.yaml``: written by the attempt that trains, never by one that fails before it does."""

import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn

from training.job.fingerprint import config_items
from training.run import storage_failure
from training.run.csv_logger import CSVLogger
from training.run.mlflow_logger import MLFlowLogger

PER_NODE = ("num_nodes", "devices")  # left out of config_items, which the nodes compare

EVALUATIONS = ("validate", "test", "predict")


def name_the_logger(config: Namespace, subcommand: str) -> None:
    """Fill in what the loggers of ``config`` (a subcommand's) leave to the template, as configs/ddp.yaml does.

    ``name: null`` (TensorBoard) and ``experiment_name: null`` (MLflow) become the model class in snake case
    without a trailing ``Model`` (``toy`` for ``models.ToyModel``): runs of another model land beside the toy's,
    not among them. ``sub_dir: null`` becomes the subcommand for validate, test and predict: their curves are a
    TensorBoard run of their own (``<run>/validate``), apart from the training curves of the run.
    """
    named = logger_name(config.model.class_path if isinstance(config.model, Namespace) else None)
    loggers = config.trainer.logger if isinstance(config.trainer.logger, list) else [config.trainer.logger]
    for logger in loggers:
        if not isinstance(logger, Namespace) or not isinstance(logger.get("init_args"), Namespace):
            continue
        for key in ("name", "experiment_name"):
            if key in logger.init_args and logger.init_args[key] is None:
                logger.init_args[key] = named
        if "sub_dir" in logger.init_args and logger.init_args.sub_dir is None and subcommand in EVALUATIONS:
            logger.init_args.sub_dir = subcommand


def logger_name(model_class_path: str | None) -> str:
    """The name a logger given ``name: null`` gets: the model class in snake case without a trailing ``Model``."""
    model = model_class_path.rsplit(".", 1)[-1] if model_class_path else "model"
    words = re.sub(r"(?<=.)(?=[A-Z][a-z])", "_", model.removesuffix("Model") or model)  # EMA_Classifier
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", words).lower()


def run_directory(trainer: Trainer) -> str | None:
    """The run's directory, a path or an object store URL: the logger's ``log_dir`` without the ``sub_dir`` that
    validate, test and predict log into (None under fast_dev_run). Reads ``trainer.log_dir``, a broadcast: every
    rank must call it."""
    log_dir = trainer.log_dir
    sub_dir = getattr(trainer.logger, "sub_dir", None)
    if log_dir is not None and isinstance(sub_dir, str) and sub_dir:
        return log_dir.rstrip("/").removesuffix("/" + sub_dir.strip("/"))
    return log_dir


class RunRecord(SaveConfigCallback):
    """Saves the config of ``fit`` when the run first saves a checkpoint (or ends training without one).

    So ``config.yaml`` always describes the training that wrote the run's ``last.ckpt``: an attempt that stops
    before it trains (a wrong setting, a run already past its end) leaves the record as it was. When the
    config changed since the record was written, the earlier one is kept as ``config-<time it was written>.yaml``.
    An attempt that fails before it saved anything also takes back the TensorBoard file and the ``hparams.yaml``
    it wrote while they hold nothing new. validate/test/predict save their own ``<subcommand>-config.yaml`` in the
    run's directory once they have run to their end (Lightning writes it at their start, and a stopped predict would
    leave the config of predictions it never wrote).
    """

    log_dir: str | None = None  # the run's directory
    started_at: int | None = None  # the step training started from, once it has
    had_hparams: set[str] | None = None  # the logger directories that held an hparams.yaml at set-up

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        storage_failure.quiet_writer_threads()
        if self.already_saved:
            return
        self.log_dir = run_directory(trainer)  # a broadcast: read here, where every rank takes part
        self.had_hparams = {logger.log_dir for logger in self.file_loggers(trainer) if hparams(logger).is_file()}

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
        if self.started_at is not None and trainer.global_step > self.started_at:
            self.write(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.take_back(trainer)
        if trainer.world_size == 1:  # a job's processes stop it themselves (training/strategy.py)
            storage_failure.explain_alone(exception, trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.take_back(trainer)  # a rerun of a finished run ends here without training, and without an exception

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:  # not fit's validation
            self.write(trainer, "validate")

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.write(trainer, "test")

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.write(trainer, "predict")
        self.take_back(trainer)  # predict logs no metrics: nothing to keep in its logger's directory

    @staticmethod
    def file_loggers(trainer: Trainer) -> list[TensorBoardLogger | CSVLogger]:
        return [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger | CSVLogger)]

    def take_back(self, trainer: Trainer) -> None:
        """Removes the TensorBoard file this attempt opened when it holds nothing, and the ``hparams.yaml`` an attempt
        that logged nothing wrote, with the directory when that leaves it empty: an attempt that saved and logged
        nothing leaves the run's directory as it found it."""
        if (self.already_saved and trainer.state.fn == "fit") or not trainer.is_global_zero:
            return
        for logger in self.file_loggers(trainer):
            if not os.path.isdir(logger.log_dir):
                continue
            if isinstance(logger, TensorBoardLogger):
                try:
                    empty = empty_event_files(logger)
                except OSError:  # its writer failed (a full disk), which the job's paragraph names; files stay
                    continue
                if not empty:
                    continue
                for path in empty:
                    path.unlink()
            elif logger.writer and logger.writer.metrics or (Path(logger.log_dir) / "metrics.csv").exists():
                continue  # rows logged, written now or at the logger's finalize
            if self.had_hparams is not None and logger.log_dir not in self.had_hparams:  # None: set-up never came
                hparams(logger).unlink(missing_ok=True)
            if not any(Path(logger.log_dir).iterdir()):
                Path(logger.log_dir).rmdir()

    def write(self, trainer: Trainer, stage: str = "fit") -> None:
        if self.already_saved or self.log_dir is None:
            return
        self.already_saved = True
        if not trainer.is_global_zero:
            return
        fs = get_filesystem(self.log_dir)
        # validate/test/predict log into the run too; their configs must not overwrite the training one.
        name = self.config_filename if stage == "fit" else f"{trainer.state.fn.value}-{self.config_filename}"
        path = f"{self.log_dir.rstrip('/')}/{name}"
        text = self.parser.dump(self.config, skip_none=False)
        if fs.isfile(path) and stage == "fit":
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
        self.save_config(trainer, trainer.lightning_module, stage)


def hparams(logger: TensorBoardLogger | CSVLogger) -> Path:
    return Path(logger.log_dir) / "hparams.yaml"


def empty_event_files(logger: TensorBoardLogger) -> list[Path]:
    """The event files this process opened in the logger's directory that hold nothing but their header."""
    # Here, not at the top: it imports most of TensorBoard (0.3 s of CPU), which no other rank needs.
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    logger.experiment.close()
    mine = re.compile(rf"events\.out\.tfevents\..*\.{os.getpid()}\.\d+")  # its name ends in pid.counter
    return [
        path
        for path in Path(logger.log_dir).iterdir()
        if mine.fullmatch(path.name) and len(list(EventFileLoader(str(path)).Load())) <= 1  # the header
    ]
