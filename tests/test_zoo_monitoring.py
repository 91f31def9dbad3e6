"""The zoo's modules that differ in what they give checkpointing to watch, each run as a user would: 2-process jobs
of ``cli.py -c configs/ddp.yaml --model ... --data ...`` (fit, the same command again, validate, predict), set beside
plain LightningCLI on the same module. The same command again and validate run in one process where a second would
change nothing they check (that nothing is trained, which weights are used); the saturating run's same command again
stays in two. A module without validation is tests/test_zoo_optimization.py's GAN.

- tests.zoo.PlateauClassifier logs ``val_loss`` (not the template's ``val/loss``) and steps a ReduceLROnPlateau on
  it: ``--monitor val_loss`` makes checkpointing watch it and name the best checkpoint by it. Its run logs with
  ``--trainer.logger=training.CSVLogger``, is continued with more epochs, validated and predicted: its metrics.csv
  files keep every row. Plain LightningCLI needs no monitor (its ModelCheckpoint watches nothing) and its CSVLogger
  writes a new version per command; the template keeps one run directory, where Lightning's CSVLogger would delete
  metrics.csv, so it takes its own.
- tests.zoo.SaturatingClassifier: its ``val/acc`` (``--monitor val/acc --monitor_mode max``) reaches 1.0 in the
  first epoch and never improves: the best checkpoint stays there, last.ckpt follows the run to its end, and the same
  command again leaves both as they were. This run is where the suite proves that rule of last.ckpt in 2 processes
  (tests/test_last_checkpoint.py proves the rest in one).
"""

import csv
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    DDP_YAML,
    SINGLE_PROCESS,
    cli_job,
    plain_predictions,
    succeeded,
)
from training.checkpoints.contents import counters

PLATEAU = ["--model", "tests.zoo.PlateauClassifier", "--data", "tests.zoo.Blobs"]
SATURATING = ["--model", "tests.zoo.SaturatingClassifier", "--data", "tests.zoo.Blobs"]
EPOCHS = 3  # of the saturating run
BATCHES_PER_EPOCH = 4  # tests.zoo.Blobs: 64 training points, 8 per batch, 2 processes


def csv_rows(run: Path) -> list[tuple]:
    """Every row of every metrics.csv in the run's directory, its empty cells left out."""
    rows = []
    for path in sorted(run.rglob("metrics.csv")):
        with path.open() as file:
            rows += [tuple(sorted((k, v) for k, v in row.items() if v)) for row in csv.DictReader(file)]
    return sorted(rows)


def kept(earlier: list[tuple], later: list[tuple]) -> bool:
    """Whether every row of ``earlier`` is still among ``later``'s (as many times)."""
    remaining = list(later)
    for row in earlier:
        if row not in remaining:
            return False
        remaining.remove(row)
    return True


def val_loss_epochs(rows: list[tuple]) -> list[int]:
    return sorted(int(dict(row)["epoch"]) for row in rows if "val_loss" in dict(row))


def last_and_best(run: Path) -> tuple[dict, Path]:
    """The run's last.ckpt, and the path of its best checkpoint (the one file beside it)."""
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    (best,) = [path for path in (run / "checkpoints").glob("*.ckpt") if not path.name.startswith("last")]
    return last, best


def checkpoint_state(checkpoint: dict) -> dict:
    (state,) = [value for key, value in checkpoint["callbacks"].items() if key.startswith("ModelCheckpoint")]
    return state


@pytest.fixture(scope="module")
def plateau(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("plateau")
    run = workdir / "logs" / "plateau_classifier" / "plateau"
    flags = ["-c", DDP_YAML, *PLATEAU, "--monitor", "val_loss", "--trainer.logger=training.CSVLogger"]
    commands = {
        "fit": ["fit", *flags, "--trainer.max_epochs=2"],
        "again": ["fit", *flags, "--trainer.max_epochs=2", *SINGLE_PROCESS],
        "more": ["fit", *flags, "--trainer.max_epochs=3"],
        "validate": ["validate", *flags, *SINGLE_PROCESS],
        "predict": ["predict", *flags],
    }
    results, rows, schedulers = {}, {}, {}
    for stage, command in commands.items():
        results[stage] = cli_job(workdir, "plateau", *command)
        rows[stage] = csv_rows(run)
        if (run / "checkpoints" / "last.ckpt").is_file():
            schedulers[stage] = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["lr_schedulers"]
    return {"run": run, "results": results, "rows": rows, "schedulers": schedulers}


@pytest.mark.distributed
def test_val_loss_is_watched_through_the_monitor_setting_which_names_the_best_checkpoint(plateau):
    succeeded(plateau["results"]["fit"])
    last, best = last_and_best(plateau["run"])
    state = checkpoint_state(last)
    assert state["monitor"] == "val_loss"
    score = float(state["best_model_score"])
    assert "val_loss" in best.name and f"{score:.4f}" in best.name, best.name
    assert score > 0


@pytest.mark.distributed
def test_reduce_lr_on_plateau_steps_on_val_loss_once_an_epoch(plateau):
    succeeded(plateau["results"]["fit"])
    (scheduler,) = plateau["schedulers"]["fit"]
    # last.ckpt of epoch 1 was saved at the end of its validation, before Lightning stepped the scheduler: one step,
    # on epoch 0's val_loss.
    (epoch_0,) = [
        float(dict(row)["val_loss"])
        for row in plateau["rows"]["fit"]
        if dict(row).get("epoch") == "0" and "val_loss" in dict(row)
    ]
    assert scheduler["last_epoch"] == 1
    assert scheduler["best"] == pytest.approx(epoch_0)


@pytest.mark.distributed
def test_the_same_command_again_trains_nothing_and_more_epochs_continue_the_run(plateau):
    assert "Nothing to train: the run in logs/plateau_classifier/plateau already" in succeeded(
        plateau["results"]["again"]
    )
    more = succeeded(plateau["results"]["more"])
    assert re.search(r"Resuming from \S+/plateau/checkpoints/last\.ckpt \(epoch 1, step \d+\)", more), more
    assert counters(plateau["run"] / "checkpoints" / "last.ckpt")[0] == 3


@pytest.mark.distributed
def test_the_csv_history_survives_the_same_command_more_epochs_validate_and_predict(plateau):
    rows = plateau["rows"]
    assert val_loss_epochs(rows["fit"]) == [0, 1]
    for earlier, later in [("fit", "again"), ("again", "more"), ("more", "validate"), ("validate", "predict")]:
        assert kept(rows[earlier], rows[later]), f"{later} lost rows that {earlier} left"
    assert val_loss_epochs(rows["more"]) == [0, 1, 2]
    assert len(val_loss_epochs(rows["validate"])) == 4  # validate logged its own val_loss


@pytest.mark.distributed
def test_validate_and_predict_use_the_last_weights_and_predict_what_plain_lightning_cli_predicts(plateau):
    step = torch.load(plateau["run"] / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    last = rf"\S+/plateau/checkpoints/last\.ckpt \(epoch \d+, step {step}\)"
    assert re.search(f"Validating with the weights of {last}", succeeded(plateau["results"]["validate"]))
    assert re.search(f"Predicting with the weights of {last}", succeeded(plateau["results"]["predict"]))
    written = torch.load(plateau["run"] / "predictions.pt")
    torch.testing.assert_close(written, plain_predictions(plateau["run"] / "checkpoints" / "last.ckpt", *PLATEAU))


@pytest.fixture(scope="module")
def saturating(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("saturating")
    run = workdir / "logs" / "saturating_classifier" / "saturating"
    flags = ["-c", DDP_YAML, *SATURATING, "--monitor", "val/acc", "--monitor_mode", "max"]
    fit = cli_job(workdir, "saturating", "fit", *flags, f"--trainer.max_epochs={EPOCHS}")
    # As the fit left them, and as the same command again left them.
    files = {path.name: path.read_bytes() for path in (run / "checkpoints").glob("*.ckpt")}
    checkpoints = {name: counters(run / "checkpoints" / name) for name in files}
    again = cli_job(workdir, "saturating", "fit", *flags, f"--trainer.max_epochs={EPOCHS}")
    return {
        "run": run,
        "fit": fit,
        "files": files,
        "checkpoints": checkpoints,
        "again": again,
        "files_again": {path.name: path.read_bytes() for path in (run / "checkpoints").glob("*.ckpt")},
        "validate": cli_job(workdir, "saturating", "validate", *flags, *SINGLE_PROCESS),
        "predict": cli_job(workdir, "saturating", "predict", *flags),
    }


@pytest.mark.distributed
def test_a_saturated_metric_keeps_the_best_checkpoint_at_its_first_epoch_and_last_ckpt_at_the_end(saturating):
    succeeded(saturating["fit"])
    last, best_path = last_and_best(saturating["run"])
    assert float(checkpoint_state(last)["best_model_score"]) == 1.0
    assert "1.0000" in best_path.name
    assert sorted(saturating["files"]) == ["epoch000-val_acc1.0000.ckpt", "last.ckpt"]
    best_epochs, best_steps = saturating["checkpoints"][best_path.name]
    assert best_epochs == 1
    assert saturating["checkpoints"]["last.ckpt"] == (EPOCHS, EPOCHS * best_steps)
    best = torch.load(best_path, weights_only=True)
    assert (best["epoch"], best["global_step"]) == (0, BATCHES_PER_EPOCH)
    assert (last["epoch"], last["global_step"]) == (EPOCHS - 1, EPOCHS * BATCHES_PER_EPOCH)
    assert not torch.equal(best["state_dict"]["layer.weight"], last["state_dict"]["layer.weight"]), "it trained on"
    # A run resumed from last.ckpt knows its best checkpoint, and replaces it when a better one comes.
    assert Path(checkpoint_state(last)["best_model_path"]).name == "epoch000-val_acc1.0000.ckpt"


@pytest.mark.distributed
def test_a_saturated_run_again_trains_nothing_and_validates_and_predicts_with_its_last_weights(saturating):
    again = succeeded(saturating["again"])
    last = rf"\S+/saturating/checkpoints/last\.ckpt \(epoch {EPOCHS - 1}, step {EPOCHS * BATCHES_PER_EPOCH}\)"
    assert re.search(f"Resuming from {last}", again), again
    assert "Nothing to train: the run in logs/saturating_classifier/saturating already" in again
    assert saturating["files_again"] == saturating["files"]
    validated = succeeded(saturating["validate"])
    assert re.search(f"Validating with the weights of {last}", validated), validated
    assert re.search(r"val/acc\s+[01]\.\d+", validated), validated
    assert re.search(f"Predicting with the weights of {last}", succeeded(saturating["predict"]))
    written = torch.load(saturating["run"] / "predictions.pt")
    checkpoint = saturating["run"] / "checkpoints" / "last.ckpt"
    torch.testing.assert_close(written, plain_predictions(checkpoint, *SATURATING))
