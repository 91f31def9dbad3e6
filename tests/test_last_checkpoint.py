"""last.ckpt is the run's latest state whatever the monitored metric does, while the best checkpoint keeps its own
rule: a run that checkpoints every N steps; a model without validation. A 2-process run whose metric never improves
after epoch 0, the same command again and validate are tests/test_zoo_monitoring.py's saturating run."""

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from models import ToyModel
from tests.helpers import DDP_YAML, SINGLE_PROCESS


class Plateau(ToyModel):
    """The toy, whose validation loss stays at one value: the best checkpoint stays at epoch 0 while the weights go
    on training."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", 1.0, sync_dist=True)


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_every_n_train_steps_writes_last_ckpt_at_those_steps_and_at_each_epochs_end(run_cli, tmp_path):
    # LastCheckpoint of configs/ddp.yaml, a list entry, is set in a copy of that file.
    ddp = Path(DDP_YAML).read_text()
    every = "every_n_train_steps: null"
    assert ddp.count(every) == 1
    steps = tmp_path / "steps.yaml"
    steps.write_text(ddp.replace(every, "every_n_train_steps: 3"))
    model = ["--model=tests.test_last_checkpoint.Plateau", "--trainer.limit_train_batches=5", "--trainer.max_epochs=2"]
    cli = run_cli("fit", "-c", str(steps), "-c", str(writes_at_once(tmp_path)), *SINGLE_PROCESS, *model, *PROBE)
    # Written at steps 3, 5 (epoch 0's end), 6, 9 and 10 (epoch 1's end).
    assert probed(cli).seen == [None, (0, 5)]
    checkpoints = tmp_path / "logs" / "plateau" / "default" / "checkpoints"
    last = load(checkpoints / "last.ckpt")
    assert (last["epoch"], last["global_step"]) == (1, 10)


class TrainOnlyData(LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)


class TrainOnly(LightningModule):
    """A module with a training loop only: no validation_step, and its data no val dataloader."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TrainOnlyDrawingAtValidationEnd(TrainOnly):
    """Draws samples for its loggers at the end of a validation, as Lightning's GAN example does: a hook that a run
    without validation never calls."""

    def on_validation_epoch_end(self) -> None:
        self.samples = self.layer(torch.zeros(4, 4)).detach()


class LastAtEpochStart(Callback):
    """(epoch, step) of last.ckpt as each epoch starts, once the checkpoints of the epoch before are written."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int] | None] = []

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        path = Path(trainer.checkpoint_callback.dirpath) / "last.ckpt"
        self.seen.append((load(path)["epoch"], load(path)["global_step"]) if path.exists() else None)


PROBE = ["--trainer.callbacks+=tests.test_last_checkpoint.LastAtEpochStart", "--trainer.limit_val_batches=1"]


def probed(cli) -> LastAtEpochStart:
    [probe] = [callback for callback in cli.trainer.callbacks if isinstance(callback, LastAtEpochStart)]
    return probe


def writes_at_once(tmp_path: Path) -> Path:
    """A config without background writes: last.ckpt is whole when the next epoch starts."""
    config = tmp_path / "at_once.yaml"
    config.write_text(
        "trainer:\n  plugins:\n    - class_path: training.AtomicCheckpointIO\n      init_args:\n"
        "        background: false\n"
    )
    return config


@pytest.mark.parametrize("module", ["TrainOnly", "TrainOnlyDrawingAtValidationEnd"])
def test_a_model_without_validation_trains_and_keeps_last_ckpt_every_epoch(run_cli, tmp_path, caplog, module):
    model = [f"--model=tests.test_last_checkpoint.{module}", "--data=tests.test_last_checkpoint.TrainOnlyData"]
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        cli = run_cli("fit", "-c", DDP_YAML, "-c", str(writes_at_once(tmp_path)), *SINGLE_PROCESS, *model, *PROBE)
    assert not [str(w.message) for w in warned if "could not find the monitored key" in str(w.message)]
    assert "The model has no validation (no validation_step, no val dataloader" in caplog.text
    assert "no best checkpoint by 'val/loss'; last.ckpt holds the latest state" in caplog.text
    assert probed(cli).seen == [None, (0, 4), (1, 8), (2, 12), (3, 16)]
    checkpoints = Path(cli.trainer.checkpoint_callback.dirpath)
    assert sorted(path.name for path in checkpoints.iterdir()) == ["last.ckpt"]
    assert load(checkpoints / "last.ckpt")["epoch"] == 4
