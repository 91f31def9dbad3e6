"""LightningModules and DataModules written the way users write them, not the way the template's own are.

Each follows the shape of a well-known public example, on tiny random tensors: a GAN with manual optimization and
two optimizers and no validation (Lightning's GAN example), a classifier that logs ``val_loss`` and steps a
ReduceLROnPlateau on it (Lightning's docs) or a OneCycleLR sized by the run's total steps, a module given a partial
optimizer and scheduler and its network (lightning-hydra-template's MNIST module), a classifier whose accuracy
saturates (a plateau), one whose learning rate explodes after its first epoch, samples read one at a time by
DataLoader workers from storage that can hang (in training, or in validation and prediction), a stream without a
length read from shards that ``prepare_data`` writes, an attention layer whose memory grows with the square of its
sequences' length, a regressor that compiles its network with torch.compile when asked, one that keeps numpy
statistics in its checkpoints, and an evaluation that computes its figures with self.log, torchmetrics and
self.all_gather at the epoch's end.
"""

import contextlib
import json
import os
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from torchmetrics import MaxMetric, MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy


class Blobs(LightningDataModule):
    """Points around ``num_classes`` well separated centres, as ``(x, label)``: a training loader, and held-out points
    as validation and predict data."""

    def __init__(
        self, num_train: int = 64, num_val: int = 32, dim: int = 4, num_classes: int = 3, batch_size: int = 8
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        hp = self.hparams
        generator = torch.Generator().manual_seed(0)
        centres = 8 * torch.randn(hp.num_classes, hp.dim, generator=generator)
        labels = torch.randint(hp.num_classes, (hp.num_train + hp.num_val,), generator=generator)
        x = centres[labels] + torch.randn(len(labels), hp.dim, generator=generator)
        self.train_set = TensorDataset(x[: hp.num_train], labels[: hp.num_train])
        self.val_set = TensorDataset(x[hp.num_train :], labels[hp.num_train :])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class Reads(Dataset):
    """``(x, y)`` pairs read one at a time, as from files on a network mount; the ``stall_at``-th read of a worker of
    global rank ``stall_rank`` hangs while ``stall_file`` exists (a dead mount), once it wrote its pid to
    ``<stall_file>.rank<R>``; its ``corrupt_at``-th read (0: none) raises, as a corrupt sample does."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, stall_file: str, stall_rank: int, stall_at: int, corrupt_at: int = 0
    ) -> None:
        self.x, self.y = x, y
        self.stall_file, self.stall_rank, self.stall_at, self.corrupt_at = stall_file, stall_rank, stall_at, corrupt_at
        self.rank = 0
        self.reads = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        if self.rank == self.stall_rank and self.reads == self.corrupt_at:
            raise ValueError(f"sample {index} is corrupt: cannot decode it")
        if self.stall_file and self.rank == self.stall_rank and self.reads == self.stall_at:
            stall = Path(self.stall_file)
            with contextlib.suppress(FileExistsError):  # the first reader to get there hangs, the others read on
                with Path(f"{stall}.rank{self.rank}").open("x") as pid:
                    pid.write(str(os.getpid()))
                while stall.exists():
                    threading.Event().wait(0.05)  # as a read waits for an answer: innermost, threading's frame
        return self.x[index], self.y[index]


class FileSamples(LightningDataModule):
    """Regression samples read by ``num_workers`` DataLoader workers (``Reads``), the toy model's shapes linked from
    ``num_features`` and ``num_targets``."""

    def __init__(
        self,
        num_samples: int = 512,
        batch_size: int = 16,
        num_workers: int = 2,
        stall_file: str = "",
        stall_rank: int = 0,
        stall_at: int = 40,
        corrupt_at: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.num_features, self.num_targets = 8, 1

    def setup(self, stage: str) -> None:
        hp = self.hparams
        x = torch.randn(hp.num_samples, self.num_features, generator=torch.Generator().manual_seed(0))
        self.train_set = Reads(x, x.sum(dim=1, keepdim=True), hp.stall_file, hp.stall_rank, hp.stall_at, hp.corrupt_at)
        self.train_set.rank = self.trainer.global_rank if self.trainer else 0

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        return DataLoader(self.train_set, batch_size=hp.batch_size, shuffle=True, num_workers=hp.num_workers)


class HeldOutSamples(FileSamples):
    """FileSamples with held-out samples, read the same way for validation and prediction by workers that persist
    across epochs: the stall is in those reads (a worker's ``stall_at``-th, over every epoch), not in training's."""

    def __init__(
        self,
        num_samples: int = 512,
        batch_size: int = 16,
        num_workers: int = 2,
        stall_file: str = "",
        stall_rank: int = 0,
        stall_at: int = 40,
        corrupt_at: int = 0,
        num_held_out: int = 64,
    ) -> None:
        super().__init__(num_samples, batch_size, num_workers, stall_file, stall_rank, stall_at, corrupt_at)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.train_set.stall_file = ""
        x = torch.randn(self.hparams.num_held_out, self.num_features, generator=torch.Generator().manual_seed(1))
        hp = self.hparams
        self.held_out = Reads(x, x.sum(dim=1, keepdim=True), hp.stall_file, hp.stall_rank, hp.stall_at)
        self.held_out.rank = self.train_set.rank

    def val_dataloader(self) -> DataLoader:
        hp = self.hparams
        return DataLoader(
            self.held_out, batch_size=hp.batch_size, num_workers=hp.num_workers, persistent_workers=hp.num_workers > 0
        )

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class Samples(LightningDataModule):
    """Real samples for a GAN to imitate (``dim`` numbers near a fixed pattern), and latent vectors to predict from."""

    def __init__(self, num_samples: int = 64, dim: int = 8, latent_dim: int = 4, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        hp = self.hparams
        generator = torch.Generator().manual_seed(0)
        pattern = torch.linspace(-1, 1, hp.dim)
        self.samples = TensorDataset(pattern + 0.1 * torch.randn(hp.num_samples, hp.dim, generator=generator))
        self.latents = TensorDataset(torch.randn(24, hp.latent_dim, generator=generator))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.samples, batch_size=self.hparams.batch_size, shuffle=True)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.latents, batch_size=self.hparams.batch_size)


class GAN(LightningModule):
    """Manual optimization with a generator and a discriminator, each with its own optimizer: each backward pass
    leaves the other network's parameters without a gradient."""

    def __init__(self, latent_dim: int = 4, dim: int = 8, hidden: int = 16, lr: float = 0.002) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(latent_dim, hidden), nn.ReLU(), nn.Linear(hidden, dim), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(dim, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def adversarial_loss(self, logits: torch.Tensor, real: bool) -> torch.Tensor:
        target = torch.ones_like(logits) if real else torch.zeros_like(logits)
        return F.binary_cross_entropy_with_logits(logits, target)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (real,) = batch
        optimizer_g, optimizer_d = self.optimizers()
        z = torch.randn(len(real), self.hparams.latent_dim, device=self.device)

        self.toggle_optimizer(optimizer_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), real=True)
        self.manual_backward(g_loss)
        optimizer_g.step()
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)

        self.toggle_optimizer(optimizer_d)
        fake = self(z).detach()
        d_loss = (
            self.adversarial_loss(self.discriminator(real), True)
            + self.adversarial_loss(self.discriminator(fake), False)
        ) / 2
        self.manual_backward(d_loss)
        optimizer_d.step()
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        # As Lightning's GAN example: samples of fixed latents for the loggers, in a hook no run of this module reaches.
        self.samples = self(torch.zeros(8, self.hparams.latent_dim, device=self.device)).detach()

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        betas = (0.5, 0.999)
        optimizer_g = torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas)
        optimizer_d = torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas)
        return optimizer_g, optimizer_d


class PlateauClassifier(LightningModule):
    """Logs ``val_loss`` (Lightning's docs' name) and lowers its learning rate when ``val_loss`` stops falling."""

    def __init__(self, dim: int = 4, num_classes: int = 3, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).softmax(dim=-1)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


class SkippingClassifier(PlateauClassifier):
    """Skips a batch it cannot learn from by returning None from ``training_step``, as Lightning's docs allow: here
    batch ``skip_batch`` of every epoch, on every process."""

    def __init__(
        self, dim: int = 4, num_classes: int = 3, hidden: int = 16, lr: float = 0.05, skip_batch: int = 2
    ) -> None:
        super().__init__(dim, num_classes, hidden, lr)
        self.skip_batch = skip_batch

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        return None if batch_idx == self.skip_batch else super().training_step(batch, batch_idx)


class ExplodingClassifier(PlateauClassifier):
    """Plain SGD whose learning rate grows ``gamma`` times each epoch, a warm-up gone wrong: the first epoch trains,
    a later one diverges until its loss is inf or NaN."""

    def __init__(
        self, dim: int = 4, num_classes: int = 3, hidden: int = 16, lr: float = 0.05, gamma: float = 1e6
    ) -> None:
        super().__init__(dim, num_classes, hidden, lr)
        self.gamma = gamma

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.ExponentialLR(optimizer, self.gamma)}


class OneCycleClassifier(PlateauClassifier):
    """Steps a OneCycleLR every batch, sized by the run's total steps, as its PyTorch and Lightning examples do."""

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Classifier(nn.Module):
    """The network the module below is given, as lightning-hydra-template passes its ``net``."""

    def __init__(self, dim: int = 4, hidden: int = 16, num_classes: int = 3) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class PartialOptimizerModule(LightningModule):
    """A network, an optimizer and a scheduler passed in, the optimizer and scheduler partially applied: the module
    gives them its parameters and optimizer. One metric object per stage, ``{stage}/loss`` names."""

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerCallable = torch.optim.SGD,
        scheduler: LRSchedulerCallable | None = None,
        num_classes: int = 3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False, ignore=["net"])
        self.net = net
        # lightning-hydra-template calls self.hparams.optimizer; under LightningCLI hparams hold the config instead.
        self.optimizer, self.scheduler = optimizer, scheduler
        self.train_loss, self.val_loss = MeanMetric(), MeanMetric()
        self.val_acc = MulticlassAccuracy(num_classes)
        self.val_acc_best = MaxMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def model_step(self, batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y), logits.argmax(dim=1), y

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _, _ = self.model_step(batch)
        self.train_loss(loss)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.val_acc_best(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(dim=1)

    def configure_optimizers(self) -> dict:
        optimizer = self.optimizer(params=self.trainer.model.parameters())
        if self.scheduler is None:
            return {"optimizer": optimizer}
        scheduler = self.scheduler(optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss"}}


class SaturatingClassifier(LightningModule):
    """A classifier of well separated classes: validation accuracy reaches 1.0 in the first epoch and stays there,
    so the monitored ``val/acc`` (mode max) never improves again."""

    def __init__(self, dim: int = 4, num_classes: int = 3, lr: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(dim, num_classes)
        self.val_acc = MulticlassAccuracy(num_classes)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_acc(self.layer(x), y)
        self.log("val/acc", self.val_acc)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).argmax(dim=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class ShardStream(IterableDataset):
    """The samples of this rank's shards (every ``world_size``-th file from ``rank``), read one shard at a time, in
    the order written; no ``__len__``, as a stream read from files seldom knows its length."""

    def __init__(self, shards: list[Path], rank: int, world_size: int) -> None:
        self.shards = shards[rank::world_size]

    def __iter__(self):
        for shard in self.shards:
            x, y = torch.load(shard, weights_only=True)
            yield from zip(x, y, strict=True)


class Shards(LightningDataModule):
    """Regression samples that ``prepare_data`` writes to ``num_shards`` files in ``data_dir``, streamed by each rank
    from its own shards (``ShardStream``); the toy model's shapes linked from ``num_features`` and ``num_targets``."""

    def __init__(
        self, data_dir: str = "shards", num_shards: int = 8, shard_size: int = 256, batch_size: int = 16
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.num_features, self.num_targets = 8, 1

    def prepare_data(self) -> None:
        hp = self.hparams
        Path(hp.data_dir).mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(0)
        for index in range(hp.num_shards):
            x = torch.randn(hp.shard_size, self.num_features, generator=generator)
            torch.save((x, x.sum(dim=1, keepdim=True)), Path(hp.data_dir) / f"shard-{index:03d}.pt")

    def train_dataloader(self) -> DataLoader:
        shards = sorted(Path(self.hparams.data_dir).glob("shard-*.pt"))
        rank, world_size = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        return DataLoader(ShardStream(shards, rank, world_size), batch_size=self.hparams.batch_size)


class RandomSequences(Dataset):
    """``(sequence, target)`` pairs of ``seq_len`` vectors of ``dim`` numbers, drawn from the index: no data held."""

    def __init__(self, num_samples: int, seq_len: int, dim: int) -> None:
        self.num_samples, self.seq_len, self.dim = num_samples, seq_len, dim

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.seq_len, self.dim, generator=torch.Generator().manual_seed(index))
        return x, x.mean(dim=0).sum(dim=0, keepdim=True)


class Sequences(LightningDataModule):
    """Sequences of ``seq_len`` steps, for a model that attends over them (``AttentionRegressor``)."""

    def __init__(self, num_samples: int = 64, seq_len: int = 32, dim: int = 4, batch_size: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        return DataLoader(RandomSequences(hp.num_samples, hp.seq_len, hp.dim), batch_size=hp.batch_size)


class AttentionRegressor(LightningModule):
    """One self-attention layer over a sequence, written out as tutorials write it: its scores take memory in the
    square of the sequence length."""

    def __init__(self, dim: int = 4, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        return self.head((scores.softmax(dim=-1) @ v).mean(dim=1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class MaybeCompiled(LightningModule):
    """A regressor that compiles its network when asked (``--model.init_args.compile_backend=inductor``), as users
    add torch.compile to a module: its checkpoints' keys then carry torch.compile's ``_orig_mod.``."""

    def __init__(self, in_features: int = 32, out_features: int = 8, compile_backend: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        net = nn.Sequential(nn.Linear(in_features, 16), nn.ReLU(), nn.Linear(16, out_features))
        self.net = torch.compile(net, backend=compile_backend) if compile_backend else net

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class NumpyStatistics(MaybeCompiled):
    """A regressor that keeps a running mean of its targets as a numpy array and saves it in its checkpoints, as users
    keep a scaler's statistics (``on_save_checkpoint``)."""

    def __init__(self, in_features: int = 32, out_features: int = 8) -> None:
        super().__init__(in_features, out_features)
        self.target_mean = np.zeros(out_features)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        self.target_mean = 0.9 * self.target_mean + 0.1 * batch[1].mean(0).numpy()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["target_mean"] = self.target_mean

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.target_mean = checkpoint["target_mean"]


class Numbered(LightningDataModule):
    """The numbers 0 to ``num_samples - 1``, one a sample, as the validation and the test set."""

    def __init__(self, num_samples: int = 11, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.numbers = TensorDataset(torch.arange(self.hparams.num_samples, dtype=torch.float32))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.numbers, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class NumberCounter(LightningModule):
    """Evaluation figures the three ways the field computes them: a batch mean through ``self.log`` with
    ``sync_dist``, torchmetrics' sum and count, and the epoch's outputs kept and gathered with ``self.all_gather`` at
    its end. Global rank 0 writes them to ``figures.json``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.total, self.count = SumMetric(), SumMetric()
        self.kept: list[torch.Tensor] = []

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (numbers,) = batch
        self.log("test/mean", numbers.mean(), sync_dist=True, batch_size=len(numbers))
        self.total.update(numbers)
        self.count.update(torch.ones_like(numbers))
        self.kept.append(numbers)

    def on_test_epoch_end(self) -> None:
        gathered = self.all_gather(torch.cat(self.kept)).flatten()
        self.figures = {"sum": self.total.compute().item(), "count": self.count.compute().item()}
        self.figures["gathered"] = gathered.tolist()

    def on_test_end(self) -> None:  # once self.log's epoch figures are reduced
        if self.trainer.is_global_zero:
            mean = self.trainer.callback_metrics["test/mean"].item()
            Path("figures.json").write_text(json.dumps({**self.figures, "mean": mean}))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)
