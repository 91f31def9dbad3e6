"""configs/mlflow.yaml: MLflow beside TensorBoard, against a real tracking server on loopback (sqlite store); one
MLflow run per run id across restarts; an unreachable server stops the run at start; only global rank 0 talks."""

import os
import signal
import sys
from pathlib import Path

import pytest
import requests
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS, free_port, made_once, pip_install, run_script, serve
from training.run.mlflow_logger import RUN_TAG, MLFlowLogger

MLFLOW_YAML = str(REPO / "configs" / "mlflow.yaml")
STEPS = 4  # training steps per epoch


def fit(run_cli, *args: str):
    return run_cli(
        "fit",
        "-c",
        DDP_YAML,
        "-c",
        MLFLOW_YAML,
        *SINGLE_PROCESS,
        f"--trainer.limit_train_batches={STEPS}",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=2",
        *args,
    )


# The tracking server is the full mlflow package, with scipy, pandas and scikit-learn, in an environment of its own:
# the tests' environment has the client alone, as a user's does (requirements-mlflow.txt), and none of those for
# torchmetrics to import in every training process. It is made once per machine (tests.helpers.made_once).
SERVER_REQUIREMENTS = REPO / "requirements-mlflow-server.txt"


def make_server_environment(path: Path) -> None:
    made = run_script([sys.executable, "-m", "venv", str(path)], cwd=REPO)
    assert made.returncode == 0, made.stdout + made.stderr
    pip_install(path / "bin" / "python", "-r", str(SERVER_REQUIREMENTS))


def server_python() -> Path:
    """The Python of the server's environment, made from requirements-mlflow-server.txt on first use."""
    return (
        made_once(SERVER_REQUIREMENTS, "mlflow-server", make_server_environment, holds="bin/python") / "bin" / "python"
    )


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    python = str(server_python())
    command = [python, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{directory}/mlflow.db", "--default-artifact-root", str(directory)]
    # MLflow 3's job runner (GenAI evaluation jobs, which these tests never ask for) would start eight more Python
    # processes that import mlflow: about 14 s of CPU.
    jobs = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = serve(command, port, directory / "server.log", timeout=300, env=jobs)
    uri = f"http://127.0.0.1:{port}"
    assert requests.get(f"{uri}/health", timeout=60).ok
    yield uri
    os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def unreachable_uri() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


@pytest.mark.distributed
def test_a_restarted_run_continues_its_mlflow_run(tracking_uri, run_cli, monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("RUN_ID", "tracked")
    fit(run_cli, "--trainer.max_epochs=1")
    fit(run_cli, "--trainer.max_epochs=2")  # the same run, resumed, with a higher limit
    run_cli("validate", "-c", DDP_YAML, "-c", MLFLOW_YAML, *SINGLE_PROCESS, "--trainer.limit_val_batches=2")
    monkeypatch.setenv("RUN_ID", "another")
    fit(run_cli, "--trainer.max_epochs=1")

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("toy")  # named after the model, like logs/toy
    runs = {run.data.tags[RUN_TAG]: run for run in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == ["another", "tracked"], "one MLflow run per run id"
    run = runs["tracked"]
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "tracked"
    params, tags = run.data.params, run.data.tags
    assert params["model.init_args.hidden_features"] == "128"
    assert params["trainer.devices"] == "1" and params["ckpt_path"] == "last"
    assert params["trainer.max_epochs"] == "1" and tags["changed.trainer.max_epochs"] == "2"
    assert tags["checkpoint"] == str(tmp_path / "logs" / "toy" / "tracked" / "checkpoints" / "last.ckpt")
    assert tags["best_checkpoint"].startswith(str(tmp_path / "logs" / "toy" / "tracked" / "checkpoints" / "epoch"))
    validation = client.get_metric_history(run.info.run_id, "val/loss")
    assert len(validation) == 3, "one value per epoch of both attempts, and the validate's"
    steps = {metric.step for metric in client.get_metric_history(run.info.run_id, "train/loss")}
    assert min(steps) < STEPS <= max(steps), f"train/loss of both attempts: steps {sorted(steps)}"
    assert (tmp_path / "logs" / "toy" / "tracked" / "checkpoints" / "last.ckpt").is_file(), "TensorBoard's run too"


@pytest.mark.distributed  # not in the fast tier: importing mlflow alone takes seconds
def test_an_unreachable_tracking_server_stops_the_run_at_start_naming_it(run_cli, monkeypatch, capsys, tmp_path):
    uri = unreachable_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(SystemExit) as exit_info:
        fit(run_cli, "--trainer.max_epochs=1")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"error: the MLflow tracking server at {uri} does not answer (ConnectionError within 10 s)." in err
    assert "Traceback" not in err
    assert not (tmp_path / "logs" / "toy" / "default" / "checkpoints").exists(), "it trained"


@pytest.mark.distributed  # importing mlflow
def test_only_global_rank_zero_talks_to_the_tracking_server(monkeypatch):
    logger = MLFlowLogger(tracking_uri=unreachable_uri(), timeout=1)
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    logger.log_hyperparams({"lr": 0.1})  # would raise on the unreachable server if it tried
    logger.log_metrics({"train/loss": 1.0}, step=1)
    logger.log_config({"trainer.max_epochs": "1"})
    assert logger.run_id is None
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    with pytest.raises(RuntimeError, match="does not answer"):
        logger.log_metrics({"train/loss": 1.0}, step=1)


@pytest.mark.parametrize("found", [False, True], ids=["not installed", "found but cannot be imported"])
def test_mlflow_yaml_without_mlflow_names_the_requirements_file(run_cli, monkeypatch, capsys, tmp_path, found):
    # A package of that name first on the path, which cannot be imported: as mlflow missing, or broken by one of its
    # dependencies. Found or not, Lightning refuses the logger as not installed.
    stub = tmp_path / "stub" / "mlflow"
    stub.mkdir(parents=True)
    reason = "No module named 'mlflow'" if not found else "cannot import name 'descriptor' from 'google.protobuf'"
    (stub / "__init__.py").write_text(f"raise ImportError({reason!r})\n")
    monkeypatch.syspath_prepend(str(stub.parent))
    for name in [name for name in sys.modules if name == "mlflow" or name.startswith("mlflow.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(SystemExit) as exit_info:
        fit(run_cli, "--trainer.max_epochs=1")
    assert exit_info.value.code == 2
    assert (
        "error: trainer.logger has an MLFlowLogger (configs/mlflow.yaml), and the mlflow package cannot be imported "
        f"({reason}): install it with pip install -r requirements-mlflow.txt, or leave out -c configs/mlflow.yaml."
    ) in capsys.readouterr().err
