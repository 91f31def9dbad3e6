"""Streaming a shard directory: each rank reads its share of the pairs a shard at a time, in batches.

Memory holds one shard and one pool of batches per process, whatever the size of the data. The order of an
epoch is a function of the seed and the epoch only: the shards in a shuffled order, the pairs of each shard
shuffled, and rank ``r`` of ``W`` takes every ``W``-th pair from position ``r``. A rank's share is
``ceil(pairs / W)`` pairs, the last ones taken again from the start of the epoch's order, so every rank has
the same number of batches and none waits in a collective for another; at most ``W - 1`` pairs are seen
twice in an epoch, and none is left out.
"""

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data.resumable import EpochPosition
from data.shards import ShardReader

# Lightning warns of any iterable dataset with a length that worker processes could each yield it whole; each
# worker here yields its own share of the batches, so the length is exact.
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")

Item = tuple[int, str, str]  # the pair's number in the shard directory, source, target


class StreamingPairs(IterableDataset):
    """One rank's batches of a shard split, made by ``collate`` from lists of :data:`Item`.

    Training (``shuffle``): the order above; pools of ``pool_batches`` batches are sorted by length, cut into
    batches and the batches of a pool shuffled, so batches carry little padding. Validation: the rank's
    contiguous block of the split, in the order of the shards, one sample at most more or less than another
    rank's, so each pair is scored once.

    ``epoch`` and ``skip`` (batches of the epoch already trained) are set before each epoch by the loader.
    With worker processes, worker ``w`` of ``n`` yields the epoch's remaining batches ``w, w + n, ...``, the
    order DataLoader takes them in, so the batches are those of the main process.
    """

    def __init__(
        self,
        reader: ShardReader,
        batch_size: int,
        world_size: int,
        rank: int,
        collate: Callable[[list[Item]], dict[str, torch.Tensor]],
        shuffle: bool,
        seed: int = 0,
        pool_batches: int = 50,
    ) -> None:
        self.reader = reader
        self.batch_size = batch_size
        self.world_size = world_size
        self.rank = rank
        self.collate = collate
        self.shuffle = shuffle
        self.seed = seed
        self.pool_batches = pool_batches if shuffle else 1
        self.epoch = 0
        self.skip = 0
        self.first_ids = np.cumsum([0, *reader.sizes[:-1]])

    def num_samples(self) -> int:
        total = len(self.reader)
        if self.shuffle:
            return math.ceil(total / self.world_size)
        return (self.rank + 1) * total // self.world_size - self.rank * total // self.world_size

    def __len__(self) -> int:
        return math.ceil(self.num_samples() / self.batch_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # Read now, not when the first batch is asked for: the loader resets ``skip`` once the epoch has begun.
        return self.batches(self.epoch, self.skip)

    def batches(self, epoch: int, skip: int) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        pool_size = self.pool_batches * self.batch_size
        first_pool = skip // self.pool_batches  # earlier pools were trained on: not even read
        for pool_start in range(first_pool * pool_size, self.num_samples(), pool_size):
            batches = self.pool(epoch, pool_start, min(pool_start + pool_size, self.num_samples()))
            for number, batch in enumerate(batches, start=pool_start // self.batch_size):
                if number >= skip and (number - skip) % workers == worker:
                    yield self.collate(batch)

    def pool(self, epoch: int, start: int, stop: int) -> list[list[Item]]:
        items = [self.item(where) for where in self.positions(epoch, start, stop)]
        if self.shuffle:
            items.sort(key=lambda item: len(item[1]) + len(item[2]))
        batches = [items[i : i + self.batch_size] for i in range(0, len(items), self.batch_size)]
        if self.shuffle:
            order = self.rng(epoch, 1, self.rank, start).permutation(len(batches))
            batches = [batches[i] for i in order]
        return batches

    def positions(self, epoch: int, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """``(shard, row)`` of this rank's samples ``start`` to ``stop`` of the epoch."""
        sizes = np.array(self.reader.sizes)
        if not self.shuffle:
            offset = self.rank * len(self.reader) // self.world_size
            yield from self.locate(range(offset + start, offset + stop), np.arange(len(sizes)))
            return
        total = len(self.reader)
        order = self.rng(epoch, 2).permutation(len(sizes))
        rows: dict[int, np.ndarray] = {}
        for shard, row in self.locate([(self.rank + i * self.world_size) % total for i in range(start, stop)], order):
            if shard not in rows:
                rows[shard] = self.rng(epoch, 3, shard).permutation(sizes[shard])
            yield shard, int(rows[shard][row])

    def locate(self, positions, order: np.ndarray) -> Iterator[tuple[int, int]]:
        """``(shard, row)`` of positions in the shards read in ``order``."""
        ends = np.cumsum(np.array(self.reader.sizes)[order])
        for position in positions:
            k = int(np.searchsorted(ends, position, side="right"))
            yield int(order[k]), int(position - (ends[k] - self.reader.sizes[order[k]]))

    def item(self, where: tuple[int, int]) -> Item:
        shard, row = where
        source, target = self.reader.shard(shard)[row]
        return int(self.first_ids[shard]) + row, source, target

    def rng(self, epoch: int, *key: int) -> np.random.Generator:
        # Seeded by what it orders, never by the global generator: a resumed run draws the same order.
        return np.random.default_rng([self.seed, epoch, *key])


class StreamingLoader(EpochPosition, DataLoader):
    """The training loader of a :class:`StreamingPairs`: tells it the epoch, and resumes an epoch where a
    checkpoint left it (:class:`data.resumable.EpochPosition`) by skipping batches without reading them."""

    def __init__(self, dataset: StreamingPairs, trainer: Trainer | None, **kwargs: Any) -> None:
        # Its own generator: starting an epoch draws nothing from the global one, which dropout uses.
        super().__init__(dataset, batch_size=None, generator=torch.Generator(), **kwargs)
        self.trainer = trainer

    def __iter__(self) -> Iterator[Any]:
        if self.trainer is not None:
            # Lightning's own epoch for samplers; the iterator of a resumed epoch is made before it sets it.
            self.dataset.epoch = self.trainer.fit_loop.epoch_progress.current.processed
        iterator = super().__iter__()
        self.dataset.skip = 0  # only the first epoch after a resume skips
        return iterator

    def resume_at(self, batches_done: int) -> None:
        self.dataset.skip = batches_done
