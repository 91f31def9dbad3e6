"""Every logger keeps what earlier attempts of a run logged: a resumed fit, validate, test and predict add to the
run's logs and never start them over (in-process runs of one process)."""

import csv

import pytest
from lightning.pytorch.loggers import Logger

from tests.helpers import DDP_YAML, SINGLE_PROCESS
from tests.test_cli import expect_usage_error, one_paragraph
from training.run.record import logger_name


class NotebookLogger(Logger):
    """A logger the template does not know."""

    name = version = "notebook"

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_a_csv_run_keeps_every_attempts_rows_and_evaluations_log_beside_them(run_cli, tmp_path):
    args = ["-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.logger=training.CSVLogger", "--trainer.limit_val_batches=2"]
    train = ["--trainer.limit_train_batches=4", "--trainer.log_every_n_steps=1"]
    run_cli("fit", *args, *train, "--trainer.max_epochs=2")
    run = tmp_path / "logs" / "toy" / "default"
    first = rows(run / "metrics.csv")
    assert {row["epoch"] for row in first} == {"0", "1"}
    # 4 steps and a validation per epoch; training.StepTime's figures in rows of their own, of the steps after each
    # epoch's first, but for a step the machine held up for over 10 times the median step, which it leaves out as it
    # leaves out a step that compiles (a busy machine's hiccup in a step of a few ms).
    timing = [row for row in first if row["timing/node0/step_ms"]]
    assert len(first) - len(timing) == 10 and {row["step"] for row in timing} <= {"1", "2", "3", "5", "6", "7"}
    assert len(timing) == len({row["step"] for row in timing}) > 0

    run_cli("fit", *args, *train, "--trainer.max_epochs=3")  # the same run, resumed for one epoch more
    resumed = rows(run / "metrics.csv")
    assert resumed[: len(first)] == first, "the resumed attempt rewrote what the first one logged"
    added = resumed[len(first) :]
    assert {row["epoch"] for row in added} == {"2"}
    assert len([row for row in added if not row["timing/node0/step_ms"]]) == 5 and len(added) <= 5 + 3

    for subcommand in ("validate", "test", "predict"):
        run_cli(subcommand, *args)
    assert rows(run / "metrics.csv") == resumed, "an evaluation changed the training rows"
    assert [row.keys() for row in rows(run / "validate" / "metrics.csv")] == [{"epoch", "step", "val/loss"}]
    assert [row.keys() for row in rows(run / "test" / "metrics.csv")] == [{"epoch", "step", "test/loss"}]
    assert not (run / "predict").exists(), "predict logs nothing, and leaves no directory of its own"


def test_lightnings_csv_logger_which_deletes_the_runs_metrics_is_refused_naming_the_one_that_keeps_them(
    run_cli, capsys
):
    err = expect_usage_error(
        run_cli, capsys, "fit", "-c", DDP_YAML, "--trainer.logger=lightning.pytorch.loggers.CSVLogger"
    )
    paragraph = one_paragraph(err)
    assert "lightning.pytorch.loggers.CSVLogger deletes the run's metrics.csv" in paragraph
    assert "--trainer.logger=training.CSVLogger" in paragraph


def test_the_short_name_csv_logger_names_both_classes_and_what_the_templates_does(run_cli, capsys):
    paragraph = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "--trainer.logger=CSVLogger"))
    assert "lightning.pytorch.loggers.CSVLogger, training.CSVLogger" in paragraph
    assert "training.CSVLogger is the template's: Lightning's CSVLogger that appends to the run's metrics.csv" in (
        paragraph
    )


@pytest.mark.parametrize("as_list", [False, True])
def test_a_logger_the_template_does_not_know_is_refused_by_name(run_cli, capsys, as_list):
    logger = "tests.test_loggers.NotebookLogger"
    given = f"[{{class_path: {logger}}}]" if as_list else logger
    paragraph = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, f"--trainer.logger={given}"))
    assert f"trainer.logger {logger} is not known to keep what earlier attempts of a run logged" in paragraph
    assert "training.CSVLogger" in paragraph and "TensorBoardLogger" in paragraph


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("models.ToyModel", "toy"),
        ("my_pkg.MyModel", "my"),
        ("zoo.TinyResNet", "tiny_res_net"),
        ("zoo.EMAClassifier", "ema_classifier"),
        ("zoo.GPT2LMHeadModel", "gpt2_lm_head"),
        ("zoo.Model", "model"),
        (None, "model"),
    ],
)
def test_a_run_is_named_after_its_model_class_in_snake_case(model, name):
    assert logger_name(model) == name
