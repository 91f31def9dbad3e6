"""A toy network (Linear -> ReLU -> Linear) as a regression LightningModule."""

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from torch import nn
from torchmetrics import MeanMetric


class ToyModel(LightningModule):
    """Two-layer MLP trained with mean squared error.

    Args:
        in_features: input width. cli.py links it from ``data.num_features``.
        hidden_features: width of the hidden layer.
        out_features: output width. cli.py links it from ``data.num_targets``.
        dropout: dropout probability after the hidden layer.
        optimizer: optimizer class and arguments, e.g. in YAML
            ``optimizer: {class_path: torch.optim.SGD, init_args: {lr: 0.1}}``. The default, AdamW at lr 0.003
            without weight decay, is a lambda: jsonargparse reads it as that class and its arguments, which
            ``--print_config`` shows and a flag such as ``--model.init_args.optimizer.init_args.lr=0.01`` changes.
    """

    def __init__(
        self,
        in_features: int = 32,
        hidden_features: int = 128,
        out_features: int = 8,
        dropout: float = 0.0,
        optimizer: OptimizerCallable = lambda params: torch.optim.AdamW(params, lr=0.003, weight_decay=0.0),
    ) -> None:
        super().__init__()
        # A function, which a checkpoint cannot hold; under cli.py the run's config.yaml records it.
        self.save_hyperparameters(ignore="optimizer")
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden_features),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_features, out_features),
        )
        self.optimizer = optimizer
        # Epoch-level losses go through torchmetrics so they are averaged over every rank's samples.
        self.eval_loss = nn.ModuleDict({"val": MeanMetric(), "test": MeanMetric()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _shared_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        if stage == "train":
            self.log("train/loss", loss, prog_bar=True)
        else:
            metric = self.eval_loss[stage]
            metric.update(loss, weight=len(x))
            self.log(f"{stage}/loss", metric, prog_bar=True)
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "test")

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters())
