"""Lightning's CSVLogger for a run that continues: ``metrics.csv`` keeps what every earlier attempt logged.

The template runs every attempt of a run, and validate/test/predict, in the run's own directory (the logger's
``version`` is the run id). Lightning's CSVLogger deletes the ``metrics.csv`` it finds there when it starts, so a
resumed fit would drop the epochs before it and an evaluation would leave only its own rows. This one appends to
the file, and validate/test/predict log into ``<run>/<subcommand>/`` (``sub_dir``, as TensorBoard's), beside the
training rows rather than among them.
"""

import csv
import os
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from training.config.trainer_settings import entries
from training.private_api import AppendingExperimentWriter


class CSVLogger(LightningCSVLogger):
    """Lightning's CSVLogger that appends to the run's ``metrics.csv`` instead of starting it over.

    Args:
        save_dir, name, version, prefix, flush_logs_every_n_steps: as Lightning's CSVLogger.
        sub_dir: a directory inside the run for this attempt's files; cli.py sets it to validate, test or predict
            for those subcommands when it is null.
    """

    def __init__(
        self,
        save_dir: str,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
        sub_dir: str | None = None,
    ) -> None:
        super().__init__(save_dir, name, version, prefix, flush_logs_every_n_steps)
        self.sub_dir = sub_dir
        self.writer: AppendingExperimentWriter | None = None

    @property
    def log_dir(self) -> str:
        log_dir = super().log_dir
        return os.path.join(log_dir, self.sub_dir) if self.sub_dir else log_dir

    @property
    @rank_zero_experiment
    def experiment(self) -> AppendingExperimentWriter:
        if self.writer is None:
            get_filesystem(self.log_dir).makedirs(self.log_dir, exist_ok=True)
            self.writer = AppendingExperimentWriter(self.log_dir)
            self.writer.metrics_keys = header(self.writer.metrics_file_path)
        return self.writer

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self.writer is not None:  # a process that logged nothing has nothing to write
            self.save()


def header(path: str) -> list[str]:
    """The columns of the CSV file at ``path``, or none when there is no file yet."""
    fs = get_filesystem(path)
    if not fs.isfile(path):
        return []
    with fs.open(path, "r", newline="") as file:
        return next(csv.reader(file), [])


# Loggers that keep what earlier attempts of a run logged: TensorBoard writes a new event file per attempt and
# evaluations into its sub_dir; training.MLFlowLogger continues the MLflow run of the run id, and Lightning's
# opens a new MLflow run each time.
KEEP_HISTORY = (TensorBoardLogger, CSVLogger, MLFlowLogger)


def logger_problem(settings: dict[str, Any]) -> str | None:
    """Why a logger of ``settings`` (a subcommand's config, as a dict) would lose what earlier attempts of the run
    logged, or None."""
    for logger in entries((settings.get("trainer") or {}).get("logger")):
        if not isinstance(cls := logger_class(logger.get("class_path")), type):
            continue
        if issubclass(cls, KEEP_HISTORY):
            continue
        name = logger["class_path"]
        if issubclass(cls, LightningCSVLogger):
            return (
                f"trainer.logger {name} deletes the run's metrics.csv whenever it starts in the run's directory, "
                "which every later attempt of the run (the same command again) and validate, test and predict do. "
                "Use --trainer.logger=training.CSVLogger (the same arguments), which adds to the file instead, "
                "and logs validate, test and predict into the run's validate/, test/ and predict/."
            )
        return (
            f"trainer.logger {name} is not known to keep what earlier attempts of a run logged: every attempt of a "
            "run (the same command again) and validate, test and predict log with the run's version, the run id. "
            "Use a logger that keeps it: lightning.pytorch.loggers.TensorBoardLogger (configs/ddp.yaml), "
            "training.CSVLogger, or MLflow (-c configs/mlflow.yaml)."
        )
    return None


def logger_class(class_path: Any) -> type | None:
    module, _, name = str(class_path).rpartition(".")
    try:
        cls = getattr(__import__(module, fromlist=[name]), name) if module else None
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, Logger) else None
