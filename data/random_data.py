"""Seeded random regression data held in memory and served a whole batch per index lookup."""

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.accelerators import CUDAAccelerator
from torch.utils.data import DataLoader, Dataset, default_convert

from data.resumable import ResumableDataLoader


class TensorBatchDataset(Dataset):
    """Tensors indexed together; ``__getitems__`` lets the DataLoader fetch a batch with one indexing op.

    The DataLoader hands the whole list of sampled indices to ``__getitems__``, so a batch costs one
    tensor gather instead of ``batch_size`` Python calls plus a per-sample collate.
    """

    def __init__(self, *tensors: torch.Tensor) -> None:
        if len({len(t) for t in tensors}) != 1:
            raise ValueError(f"all tensors need the same length, got {[len(t) for t in tensors]}")
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(indices)
        return tuple(t[index] for t in self.tensors)


def batch_loader(dataset: TensorBatchDataset, batch_size: int, shuffle: bool, pin_memory: bool) -> DataLoader:
    # default_convert leaves the already-batched tensors as they are (default_collate would stack them again).
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, collate_fn=default_convert, pin_memory=pin_memory
    )


class RandomDataModule(LightningDataModule):
    """Inputs ``x ~ N(0, 1)`` and targets ``y = x @ W + noise`` for a fixed random ``W``: a target a model can learn.

    The same ``seed`` gives the same data on every rank and every run. Under DDP each process gets a
    disjoint shard of the training split through Lightning's DistributedSampler.

    Args:
        num_features: input width (linked to the model's ``in_features``).
        num_targets: target width (linked to the model's ``out_features``).
        num_train: training samples.
        num_val: validation samples.
        num_test: test samples; ``predict`` runs on the test inputs.
        batch_size: samples per batch **per process**; the global batch is
            ``batch_size * devices * num_nodes``.
        noise: standard deviation of the target noise, the lowest loss reachable.
        seed: seed of the data, independent of ``seed_everything``.
    """

    def __init__(
        self,
        num_features: int = 32,
        num_targets: int = 8,
        num_train: int = 8192,
        num_val: int = 1024,
        num_test: int = 1024,
        batch_size: int = 64,
        noise: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name in ("num_features", "num_targets", "num_train", "num_val", "num_test", "batch_size"):
            if locals()[name] < 1:
                raise ValueError(f"data.{name} must be a positive integer, got {locals()[name]}")
        if noise < 0:
            raise ValueError(f"data.noise must be >= 0, got {noise}")
        self.save_hyperparameters()
        self.num_features = num_features
        self.num_targets = num_targets
        self.batch_size = batch_size
        self.splits: dict[str, TensorBatchDataset] = {}

    def setup(self, stage: str) -> None:
        if self.splits:
            return
        hp = self.hparams
        generator = torch.Generator().manual_seed(hp.seed)
        total = hp.num_train + hp.num_val + hp.num_test
        x = torch.randn(total, hp.num_features, generator=generator)
        weight = torch.randn(hp.num_features, hp.num_targets, generator=generator) / hp.num_features**0.5
        y = x @ weight + hp.noise * torch.randn(total, hp.num_targets, generator=generator)
        sizes = [hp.num_train, hp.num_val, hp.num_test]
        for name, xs, ys in zip(("train", "val", "test"), x.split(sizes), y.split(sizes), strict=True):
            self.splits[name] = TensorBatchDataset(xs, ys)

    @property
    def _pin_memory(self) -> bool:
        return isinstance(self.trainer.accelerator, CUDAAccelerator) if self.trainer else False

    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(
            self.splits["train"],
            self.batch_size,
            self.trainer,
            shuffle=True,
            collate_fn=default_convert,
            pin_memory=self._pin_memory,
        )

    def val_dataloader(self) -> DataLoader:
        return batch_loader(self.splits["val"], self.batch_size, shuffle=False, pin_memory=self._pin_memory)

    def test_dataloader(self) -> DataLoader:
        return batch_loader(self.splits["test"], self.batch_size, shuffle=False, pin_memory=self._pin_memory)

    def predict_dataloader(self) -> DataLoader:
        return batch_loader(self.splits["test"], self.batch_size, shuffle=False, pin_memory=self._pin_memory)
