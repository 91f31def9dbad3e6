"""MLflow beside TensorBoard (configs/mlflow.yaml): one MLflow run per run id, however often the run restarts."""

import importlib
from argparse import Namespace
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from training.config.trainer_settings import entries
from training.job.startup import StartupError
from training.private_api import attach_mlflow_run
from training.run.storage import shown

MISSING = (
    "trainer.logger has an MLFlowLogger (configs/mlflow.yaml), and the mlflow package cannot be imported ({error}): "
    "install it with pip install -r requirements-mlflow.txt, or leave out -c configs/mlflow.yaml."
)
# The tag that names the template's run (RUN_ID) on its MLflow run: a restart looks the MLflow run up by it.
RUN_TAG = "RUN_ID"


class MLFlowLogger(LightningMLFlowLogger):
    """Lightning's MLFlowLogger that continues the MLflow run of the same run id instead of opening a new one.

    Lightning keeps no MLflow run id anywhere (a restarted job would open a second MLflow run): this logger tags its
    MLflow run with ``RUN_ID=<run_name>`` and, on its first use, looks for the newest run of the experiment with
    that tag, continues it and marks it running again. Only global rank 0 talks to the server (Lightning's logger
    does nothing on the other ranks), and that first use checks the server answers within ``timeout`` seconds: an
    unreachable server stops the run before it trains, naming the URI. After every save, the tags ``checkpoint`` and
    ``best_checkpoint`` hold the paths of the newest and the best checkpoint; training.RunRecord logs the resolved
    config as the run's parameters (``log_config``).

    Args:
        experiment_name: the MLflow experiment; None: named after the model by cli.py, like the TensorBoard
            directory (``lightning_logs`` elsewhere).
        run_name: the run id, ``${run_id:default}`` in configs/mlflow.yaml.
        tracking_uri: the tracking server, e.g. ``http://mlflow.lan:5000``.
        tags: more tags for a new MLflow run.
        timeout: seconds to wait for the tracking server's first answer.
    """

    def __init__(
        self,
        experiment_name: str | None = None,
        run_name: str = "default",
        tracking_uri: str = "http://127.0.0.1:5000",
        tags: dict[str, Any] | None = None,
        timeout: float = 10.0,
    ) -> None:
        if missing := missing_mlflow():
            raise ModuleNotFoundError(missing)
        super().__init__(
            experiment_name=experiment_name or "lightning_logs", run_name=run_name, tracking_uri=tracking_uri
        )
        self.experiment_name = experiment_name or "lightning_logs"
        self.run_name = run_name
        self.tracking_uri = tracking_uri
        self.tags = {**(tags or {}), RUN_TAG: run_name}
        self.timeout = timeout
        self.found = False

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if not self.found:  # the first use, on global rank 0
            self.found = True
            self.check_server()
            self.continue_run()
        return super().experiment

    def check_server(self) -> None:
        """Stop with one paragraph when an HTTP tracking server does not answer (MLflow's client would retry for
        minutes, then fail mid-run)."""
        if urlparse(self.tracking_uri).scheme not in ("http", "https"):
            return
        import requests  # a dependency of mlflow

        try:
            requests.get(f"{self.tracking_uri.rstrip('/')}/health", timeout=self.timeout)
        except requests.RequestException as error:
            raise StartupError(
                f"the MLflow tracking server at {self.tracking_uri} does not answer ({type(error).__name__} within "
                f"{self.timeout:g} s). Start it (mlflow server --backend-store-uri sqlite:///mlflow.db --host 0.0.0.0 "
                "--port 5000), point MLFLOW_TRACKING_URI at a running one (configs/mlflow.yaml reads it), or train "
                "without MLflow by leaving out -c configs/mlflow.yaml. Nothing was trained."
            ) from None

    def continue_run(self) -> None:
        """Attach to the newest MLflow run tagged with this run id, if the experiment has one."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.tracking_uri)
        experiment = client.get_experiment_by_name(self.experiment_name)
        if experiment is None or experiment.lifecycle_stage == "deleted":
            return
        runs = client.search_runs(
            [experiment.experiment_id],
            filter_string=f"tags.{RUN_TAG} = '{self.run_name}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        if runs:
            run_id = runs[0].info.run_id
            client.update_run(run_id, status="RUNNING")
            attach_mlflow_run(self, run_id)
            rank_zero_info(f"MLflow: continuing run {run_id} of experiment {self.experiment_name}.")

    @rank_zero_only
    def log_hyperparams(self, params: Mapping[str, Any] | Namespace) -> None:
        # The model's hyperparameters, as Lightning logs them (keys joined by "/"), through log_config: on a
        # resumed run whose model settings changed (dropout, say), Lightning's own would stop at MLflow's refusal.
        self.log_config(flat(params))

    @rank_zero_only
    def log_config(self, items: dict[str, str]) -> None:
        """Log ``items`` (the resolved config, flat) as parameters. MLflow keeps a parameter's first value for good:
        a value changed since (a resumed run with a higher trainer.max_epochs) goes to the tag ``changed.<key>``."""
        from mlflow.entities import Param, RunTag

        logged = self.experiment.get_run(self.run_id).data.params
        params = [Param(key, value[:6000]) for key, value in items.items() if key not in logged]
        tags = [
            RunTag(f"changed.{key}", value[:5000]) for key, value in items.items() if logged.get(key, value) != value
        ]
        for start in range(0, max(len(params), len(tags)), 100):  # MLflow takes at most 100 parameters a call
            self.experiment.log_batch(self.run_id, params=params[start : start + 100], tags=tags[start : start + 100])

    @rank_zero_only
    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        super().after_save_checkpoint(checkpoint_callback)
        for tag, path in (
            ("checkpoint", checkpoint_callback.last_model_path),
            ("best_checkpoint", checkpoint_callback.best_model_path if checkpoint_callback.monitor else ""),
        ):
            if path:
                self.experiment.set_tag(self.run_id, tag, shown(path))


def flat(params: Mapping[str, Any] | Namespace, prefix: str = "") -> dict[str, str]:
    """Nested parameters as ``{"optimizer/init_args/lr": "0.003", ...}``."""
    items: dict[str, str] = {}
    for key, value in (vars(params) if isinstance(params, Namespace) else params).items():
        name = f"{prefix}/{key}" if prefix else str(key)
        items.update(flat(value, name) if isinstance(value, Mapping | Namespace) else {name: str(value)})
    return items


def mlflow_problem(settings: dict[str, Any]) -> str | None:
    """Why the loggers of ``settings`` (a subcommand's config, as a dict) cannot be built, or None: an MLFlowLogger
    without mlflow, which would end in jsonargparse's report on the logger's types instead of naming the package."""
    named = [str(logger.get("class_path")) for logger in entries((settings.get("trainer") or {}).get("logger"))]
    return missing_mlflow() if any(name.endswith("MLFlowLogger") for name in named) else None


def missing_mlflow() -> str | None:
    """The paragraph when mlflow cannot be imported (not installed, or broken), or None. An import, not a look for
    the package: Lightning's MLFlowLogger imports it in every process to find out (requirements-mlflow.txt installs
    mlflow-skinny, whose metadata Lightning does not know), and refuses a broken one as not installed."""
    try:
        importlib.import_module("mlflow")
    except ImportError as error:
        return MISSING.format(error=error)
    return None
