"""A user's own module and data module under cli.py: they keep their own defaults, not the toy's; a linked argument is
never replaced without a word; LightningCLI's --optimizer and --lr_scheduler hold; a run without a config file says
what it lacks."""

import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import OptimizerCallable
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import training.config.cli
from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS
from tests.test_cli import expect_usage_error, one_paragraph
from training.config.links import given_model

HERE = "tests.test_own_module"
ONE_EPOCH = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]


class OwnModel(LightningModule):
    """Takes hidden_features and optimizer as the toy does, with defaults of its own."""

    def __init__(
        self,
        in_features: int = 4,
        hidden_features: int = 5,
        out_features: int = 2,
        optimizer: OptimizerCallable = lambda params: torch.optim.SGD(params, lr=0.1),
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden_features), nn.Linear(hidden_features, out_features))
        self.optimizer = optimizer

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters())


class PlainModel(OwnModel):
    """Leaves its optimizer to LightningCLI's --optimizer: no optimizer argument, no configure_optimizers."""

    def __init__(self, in_features: int = 4, out_features: int = 2) -> None:
        super().__init__(in_features=in_features, out_features=out_features)

    configure_optimizers = LightningModule.configure_optimizers


class OwnData(LightningDataModule):
    """Takes batch_size as the toy's data does, with a default of its own; its shapes are linked into the model."""

    def __init__(self, batch_size: int = 16, num_features: int = 3, num_targets: int = 2) -> None:
        super().__init__()
        self.batch_size, self.num_features, self.num_targets = batch_size, num_features, num_targets

    def loader(self, size: int) -> DataLoader:
        data = TensorDataset(torch.randn(size, self.num_features), torch.randn(size, self.num_targets))
        return DataLoader(data, batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self.loader(64)

    def val_dataloader(self) -> DataLoader:
        return self.loader(32)


def printed(run_cli, capsys, *args: str, flags: str = "") -> dict:
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", "-c", DDP_YAML, *args, f"--print_config{flags}")
    captured = capsys.readouterr()
    assert exit_info.value.code == 0, captured.err
    return yaml.safe_load(captured.out)


def own_classes(given_as: str, tmp_path) -> list[str]:
    if given_as == "flags":
        return ["--model", f"{HERE}.OwnModel", "--data", f"{HERE}.OwnData"]
    config = tmp_path / "own.yaml"
    config.write_text(f"model:\n  class_path: {HERE}.OwnModel\ndata:\n  class_path: {HERE}.OwnData\n")
    return ["-c", str(config)]


@pytest.mark.parametrize("given_as", ["flags", "yaml"])
def test_a_users_classes_get_their_own_defaults_and_none_of_the_toys(run_cli, capsys, tmp_path, given_as):
    config = printed(run_cli, capsys, *own_classes(given_as, tmp_path))
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    assert model["hidden_features"] == 5
    assert model["optimizer"]["class_path"] == "torch.optim.SGD" and model["optimizer"]["init_args"]["lr"] == 0.1
    assert data["batch_size"] == 16
    assert (model["in_features"], model["out_features"]) == (3, 2), "the values linked from the data"


def test_the_toy_keeps_its_own_settings(run_cli, capsys):
    for extra in ([], ["-c", str(REPO / "configs" / "aux_head.yaml")]):
        config = printed(run_cli, capsys, *extra)
        model = config["model"]["init_args"]
        assert model["hidden_features"] == 128 and config["data"]["init_args"]["batch_size"] == 64
        assert model["optimizer"]["class_path"] == "torch.optim.AdamW"
        assert model["optimizer"]["init_args"]["lr"] == 0.003 and model["optimizer"]["init_args"]["weight_decay"] == 0


def test_a_users_module_trains_with_its_own_optimizer_and_batch_size(run_cli, capsys, tmp_path):
    result = run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, *own_classes("flags", tmp_path), *ONE_EPOCH)
    assert "note: no config file" not in capsys.readouterr().err
    assert result.datamodule.batch_size == 16
    run = tmp_path / "logs" / "own" / "default"
    groups = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["optimizer_states"][0]["param_groups"]
    assert groups[0]["lr"] == 0.1 and "momentum" in groups[0], "the checkpoint's optimizer is not the module's SGD"
    recorded = yaml.safe_load((run / "config.yaml").read_text())["model"]["init_args"]
    assert recorded["in_features"] == 3 and recorded["optimizer"]["class_path"] == "torch.optim.SGD"


@pytest.mark.parametrize(
    "args, told",
    [
        (["--model.init_args.in_features=7"], "in_features=7 is given, but data.RandomDataModule has num_features=32"),
        (
            ["--data.init_args.num_targets=4", "-c", "targets.yaml"],
            "out_features=9 is given, but data.RandomDataModule has num_targets=4",
        ),
        (  # the model's default given: only the parse of what was given tells it from no value at all
            ["--data.init_args.num_features=5", "--model.init_args.in_features=32"],
            "in_features=32 is given, but data.RandomDataModule has num_features=5",
        ),
        (
            ["-c", str(REPO / "configs" / "seq2seq.yaml"), "--model.vocab_size=500", "--print_config"],
            "vocab_size=500 is given, but data.Seq2SeqDataModule has vocab_size=36",
        ),
    ],
)
def test_a_linked_argument_given_another_value_than_the_datas_is_refused_naming_both(
    run_cli, capsys, tmp_path, args, told
):
    (tmp_path / "targets.yaml").write_text("model:\n  init_args:\n    out_features: 9\n")
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, *SINGLE_PROCESS, *args))
    assert f"error: model.init_args.{told}" in err and "remove it from the config files and the command line" in err
    assert not (tmp_path / "logs").exists()


def test_a_linked_argument_equal_to_the_datas_is_accepted_and_shown(run_cli, capsys):
    for given in ([], ["--model.init_args.in_features=5"]):
        config = printed(run_cli, capsys, "--data.init_args.num_features=5", *given)
        assert config["model"]["init_args"]["in_features"] == 5
    # jsonargparse's flags: the defaults left out, the linked value still shown.
    skipping = printed(run_cli, capsys, "--data.init_args.num_features=5", flags="=skip_default")
    assert skipping["model"]["init_args"]["in_features"] == 5
    assert "fast_dev_run" in config["trainer"] and "fast_dev_run" not in skipping["trainer"]


def test_what_was_given_is_parsed_apart_only_where_a_linked_value_differs_from_the_datas(run_cli, monkeypatch):
    """The parse without defaults that tells a given value from a default costs about 0.1 s of CPU in every process:
    where the config's values already equal the data's, no given value can clash, and it is not made."""
    parses = []
    monkeypatch.setattr(training.config.cli, "given_model", lambda *args: parses.append(args) or given_model(*args))
    run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, *ONE_EPOCH)
    assert parses == []
    monkeypatch.setenv("RUN_ID", "other-width")
    trained = run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, *ONE_EPOCH, "--data.init_args.num_features=5")
    assert len(parses) == 1 and trained.model.hparams.in_features == 5


def test_optimizer_and_lr_scheduler_flags_build_the_optimizer_of_a_module_without_one(run_cli, tmp_path):
    model = ["--model", f"{HERE}.PlainModel", "--data", f"{HERE}.OwnData"]
    flags = ["--optimizer=Adam", "--optimizer.lr=0.02", "--lr_scheduler=StepLR", "--lr_scheduler.step_size=1"]
    result = run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, *model, *flags, *ONE_EPOCH)
    optimizer = result.trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.defaults["lr"] == 0.02
    assert isinstance(result.trainer.lr_scheduler_configs[0].scheduler, torch.optim.lr_scheduler.StepLR)
    recorded = yaml.safe_load((tmp_path / "logs" / "plain" / "default" / "config.yaml").read_text())
    assert recorded["optimizer"]["class_path"] == "torch.optim.Adam"


@pytest.mark.parametrize(
    "flags, told",
    [
        (
            ["--optimizer=Adam"],
            "but models.ToyModel has one, which they would replace; it chooses its optimizer with its optimizer "
            "argument: --model.init_args.optimizer=torch.optim.SGD --model.init_args.optimizer.init_args.lr=0.1",
        ),
        (["--lr_scheduler=StepLR", "--lr_scheduler.step_size=1"], "no --optimizer is given: add one, such as"),
    ],
)
def test_optimizer_flags_that_cannot_apply_are_refused_saying_how_the_module_chooses(run_cli, capsys, flags, told):
    err = one_paragraph(expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, *flags))
    assert told in err


def test_a_run_without_a_config_file_says_it_runs_on_lightnings_defaults(run_cli, capsys):
    boring = "lightning.pytorch.demos.boring_classes"
    args = ["--model", f"{boring}.BoringModel", "--data", f"{boring}.BoringDataModule", "--trainer.fast_dev_run=1"]
    run_cli("fit", *args, "--trainer.accelerator=cpu")
    assert (
        "note: no config file (-c) given: Lightning's own defaults apply, not this template's setup (configs/ddp.yaml)"
        in capsys.readouterr().err
    )
