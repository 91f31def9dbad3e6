"""training.MonitorCheck: a monitor naming a metric the model never logs stops the run in its first step, leaving the
run's directory as it was, while a metric logged at an epoch's end is never refused; the run's one ``monitor``
setting (``--monitor``) reaches every callback that watches it and names the best checkpoint."""

import pytest
import torch
import torch.nn.functional as F
import yaml

from models import ToyModel
from tests.helpers import DDP_YAML, SINGLE_PROCESS, stopped_in_the_run

ONE_EPOCH = ["--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]


class EpochLevelTrainMetric(ToyModel):
    """Logs ``train/mse`` from its training step at epoch level only: it shows among the metrics at the epoch's end."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train/mse", loss, on_step=False, on_epoch=True)
        return loss


class LateValidationMetric(ToyModel):
    """Logs ``val/score`` at the end of a validation, but not in the sanity check, as many modules do."""

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.log("val/score", torch.tensor(1.0))


class LogsValLoss(ToyModel):
    """Logs its validation loss as ``val_loss``, as Lightning's own examples do."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))


def monitoring(tmp_path, monitor: str) -> list[str]:
    config = tmp_path / "monitor.yaml"
    config.write_text(
        "trainer:\n  callbacks+:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        f"      init_args:\n        monitor: {monitor}\n        mode: max\n        dirpath: best\n"
    )
    return ["-c", str(config)]


def files_in(directory) -> dict:
    return {path: path.read_bytes() for path in directory.rglob("*") if path.is_file()}


def test_a_monitor_close_to_a_logged_name_stops_a_resumed_run_leaving_its_directory_as_it_was(
    run_cli, capsys, tmp_path
):
    run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, *ONE_EPOCH, "--trainer.max_epochs=1")
    run = tmp_path / "logs" / "toy" / "default"
    before = files_in(run)
    assert (run / "hparams.yaml") in before and (run / "config.yaml") in before
    capsys.readouterr()
    last = stopped_in_the_run(run_cli, capsys, *monitoring(tmp_path, "val/los"), *ONE_EPOCH, "--trainer.max_epochs=2")
    assert last == (
        "error: ModelCheckpoint monitors 'val/los', which the model does not log; it logs 'val/loss'. Set monitor: "
        "val/loss in the config, or log 'val/los' with self.log in the model. (Found in the first training step; "
        "Lightning would stop at the end of the first epoch.)"
    )
    assert files_in(run) == before, "the refused attempt changed the run's directory"
    assert not (tmp_path / "best").exists()


def test_a_monitor_far_from_every_logged_name_stops_a_new_run_before_it_writes_anything(run_cli, capsys, tmp_path):
    last = stopped_in_the_run(run_cli, capsys, *monitoring(tmp_path, "accuracy"), *ONE_EPOCH, "--trainer.max_epochs=1")
    assert last == (
        "error: ModelCheckpoint monitors 'accuracy', which the model does not log; it logs 'train/loss', 'val/loss'. "
        "Set monitor to one of them in the config, or log 'accuracy' with self.log in the model. (Found in the first "
        "training step; Lightning would stop at the end of the first epoch.)"
    )
    assert not (tmp_path / "logs" / "toy" / "default").exists(), "the refused run left its directory behind"


@pytest.mark.parametrize(
    "model, monitor", [("EpochLevelTrainMetric", "train/mse"), ("LateValidationMetric", "val/score")]
)
def test_a_metric_that_appears_only_at_an_epochs_end_is_not_refused(run_cli, tmp_path, model, monitor):
    model_args = ["--model", f"tests.test_monitor_check.{model}", "--model.init_args.hidden_features=8"]
    result = run_cli(
        "fit",
        "-c",
        DDP_YAML,
        *SINGLE_PROCESS,
        *monitoring(tmp_path, monitor),
        *model_args,
        *ONE_EPOCH,
        "--trainer.max_epochs=1",
    )
    assert monitor in result.trainer.callback_metrics
    assert len(list((tmp_path / "best").glob("*.ckpt"))) == 1, "the monitored checkpoint was not saved"


def test_without_a_sanity_check_only_a_monitor_close_to_a_logged_name_is_refused(run_cli, capsys, tmp_path):
    no_sanity = ["--trainer.num_sanity_val_steps=0", *ONE_EPOCH, "--trainer.max_epochs=1"]
    last = stopped_in_the_run(run_cli, capsys, *monitoring(tmp_path, "train_loss"), *no_sanity)
    assert last.startswith("error: ModelCheckpoint monitors 'train_loss', which the model does not log; it logs ")
    # The validation names are unknown until the first validation: Lightning's own check at the epoch's end.
    last = stopped_in_the_run(run_cli, capsys, *monitoring(tmp_path, "accuracy"), *no_sanity)
    assert last.startswith("error: `ModelCheckpoint(monitor='accuracy')` could not find the monitored key")


VAL_LOSS = ["--model=tests.test_monitor_check.LogsValLoss", *ONE_EPOCH]


def test_the_paragraph_for_the_runs_monitor_names_the_flag(run_cli, capsys):
    last = stopped_in_the_run(run_cli, capsys, *VAL_LOSS, "--trainer.max_epochs=1")
    assert last == (
        "error: ModelCheckpoint monitors 'val/loss', which the model does not log; it logs 'val_loss'. Set --monitor "
        "val_loss (monitor: val_loss in a config file), or log 'val/loss' with self.log in the model. (Found in the "
        "first training step; Lightning would stop at the end of the first epoch.)"
    )


def test_one_monitor_flag_chooses_the_best_checkpoint_and_names_its_file(run_cli, tmp_path):
    cli = run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, *VAL_LOSS, "--trainer.max_epochs=2", "--monitor", "val_loss")
    best = [callback for callback in cli.trainer.checkpoint_callbacks if callback.monitor == "val_loss"]
    assert len(best) == 1 and best[0].best_model_score is not None
    run = tmp_path / "logs" / "logs_val_loss" / "default"
    epoch = torch.load(best[0].best_model_path, weights_only=True)["epoch"]
    name = f"epoch{epoch:03d}-val_loss{best[0].best_model_score:.4f}.ckpt"
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == sorted([name, "last.ckpt"])
    # The run's record holds the values it ran with.
    record = yaml.safe_load((run / "config.yaml").read_text())
    assert (record["monitor"], record["monitor_mode"]) == ("val_loss", "min")
    watching = [
        callback["init_args"]
        for callback in record["trainer"]["callbacks"]
        if "monitor" in callback.get("init_args", {})
    ]
    assert [args["monitor"] for args in watching] == ["val_loss", "val_loss"]  # the best checkpoint, MonitorCheck
    assert watching[0]["filename"] == "epoch{epoch:03d}-val_loss{val_loss:.4f}"


def test_print_config_shows_the_monitor_where_each_callback_watches_it(run_cli, capsys):
    seq2seq = DDP_YAML.replace("ddp.yaml", "seq2seq.yaml")
    for args, monitor, mode, file_name in (
        ([], "val/loss", "min", "epoch{epoch:03d}-val_loss{val/loss:.4f}"),  # a '/' makes no directory
        (["-c", seq2seq], "val/exact_match", "max", "epoch{epoch:03d}-val_exact_match{val/exact_match:.4f}"),
        (["-c", seq2seq, "--monitor=val/loss", "--monitor_mode=min"], "val/loss", "min", None),
    ):
        with pytest.raises(SystemExit):
            run_cli("fit", "-c", DDP_YAML, *args, "--print_config")
        config = yaml.safe_load(capsys.readouterr().out)
        assert (config["monitor"], config["monitor_mode"]) == (monitor, mode)
        watching = {
            callback["class_path"].rsplit(".", 1)[-1]: callback["init_args"]
            for callback in config["trainer"]["callbacks"]
            if callback.get("init_args", {}).get("monitor")
        }
        assert {name: args["monitor"] for name, args in watching.items()} == dict.fromkeys(watching, monitor)
        assert {"ModelCheckpoint", "MonitorCheck"} <= watching.keys()
        assert watching["ModelCheckpoint"]["mode"] == mode
        if args:
            assert watching["StayStopped"]["mode"] == mode
        if file_name:
            assert watching["ModelCheckpoint"]["filename"] == file_name
