"""The toy model with an auxiliary head that can drop out of the loss: the case DDP's find_unused_parameters is for."""

import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import nn

from models.toy import ToyModel


class AuxHeadModel(ToyModel):
    """``ToyModel`` plus a head that reconstructs the input from the hidden layer, an auxiliary loss.

    The training loss is ``mse(prediction, y) + aux_weight * mse(reconstruction, x)``. With ``aux_weight: 0``
    (the default) the head takes no part in the loss, so its parameters get no gradient: DDP then needs
    ``find_unused_parameters: true`` (``configs/find_unused.yaml``), or the head removed.

    Args:
        in_features: input width, linked from ``data.num_features``.
        hidden_features: width of the hidden layer.
        out_features: output width, linked from ``data.num_targets``.
        aux_weight: weight of the reconstruction loss; 0 leaves the head unused.
        optimizer: optimizer class and arguments, as for ``ToyModel``.
    """

    def __init__(
        self,
        in_features: int = 32,
        hidden_features: int = 128,
        out_features: int = 8,
        aux_weight: float = 0.0,
        optimizer: OptimizerCallable = lambda params: torch.optim.AdamW(params, lr=0.003, weight_decay=0.0),
    ) -> None:
        super().__init__(
            in_features=in_features, hidden_features=hidden_features, out_features=out_features, optimizer=optimizer
        )
        if aux_weight < 0:
            raise ValueError(f"model.aux_weight must be >= 0, got {aux_weight}")
        self.aux_weight = aux_weight
        self.aux_head = nn.Linear(hidden_features, in_features)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.aux_weight > 0:
            x, _ = batch
            hidden = self.net[:-1](x)
            aux_loss = F.mse_loss(self.aux_head(hidden), x)
            self.log("train/aux_loss", aux_loss)
            loss = loss + self.aux_weight * aux_loss
        return loss
