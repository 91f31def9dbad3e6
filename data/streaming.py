"""Streaming a shard directory: each rank reads the pairs a shard at a time, and collates its share, in batches.

Memory holds one shard and one pool of steps per process, whatever the size of the data. The order of an
epoch is a function of the seed and the epoch only, never of the world size: the shards in a shuffled order,
the pairs of each shard shuffled, and optimizer step ``s`` of the epoch trains on pairs ``s * G`` to
``(s + 1) * G - 1`` of that order, ``G`` the global batch (batch size x processes x accumulated batches).
Each rank collates its part of every step, so every rank has the same number of batches and none waits in a
collective for another. A job that changes its number of processes part-way through an epoch, keeping the
global batch, goes on with the pairs the earlier steps left, each pair once. The last pairs of an epoch, fewer
than ``G``, are shared equally: fewer than one per process of them are left out, none is seen twice.
"""

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data.resumable import EpochPosition, move_epoch_position
from data.shards import ShardReader

# Lightning warns of any iterable dataset with a length that worker processes could each yield it whole; each
# worker here yields its own share of the batches, so the length is exact.
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")

Item = tuple[int, str, str]  # the pair's number in the shard directory, source, target


class StreamingPairs(IterableDataset):
    """One rank's batches of a shard split, made by ``collate`` from lists of :data:`Item`.

    Training (``shuffle``): the order above; with ``group_by_length``, in pools of 50 steps, each pool sorted by
    length, cut into steps and its steps shuffled, so batches carry little padding. The ``world_size * accumulate``
    batches of a step are consecutive slices of it; rank ``r`` takes batch ``r`` of every ``world_size``, so
    the ranks' batches at any moment are of about the same length. Validation: the rank's contiguous block of
    the split, in the order of the shards, one sample at most more or less than another rank's, so each pair
    is scored once.

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
        group_by_length: bool = True,
        accumulate: int = 1,
    ) -> None:
        self.reader = reader
        self.batch_size = batch_size
        self.world_size = world_size
        self.rank = rank
        self.collate = collate
        self.shuffle = shuffle
        self.seed = seed
        self.group_by_length = group_by_length
        self.pool_steps = 50 if group_by_length else 1
        self.accumulate = accumulate
        self.global_batch = batch_size * world_size * accumulate
        self.epoch = 0
        self.skip = 0
        self.first_ids = np.cumsum([0, *reader.sizes[:-1]])

    def full_steps(self) -> int:
        return len(self.reader) // self.global_batch

    def tail_share(self) -> int:
        """Pairs each rank takes of the last, partial step of an epoch."""
        return (len(self.reader) - self.full_steps() * self.global_batch) // self.world_size

    def __len__(self) -> int:
        if self.shuffle:
            return self.full_steps() * self.accumulate + math.ceil(self.tail_share() / self.batch_size)
        total = len(self.reader)
        share = (self.rank + 1) * total // self.world_size - self.rank * total // self.world_size
        return math.ceil(share / self.batch_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # Read now, not when the first batch is asked for: the loader resets ``skip`` once the epoch has begun.
        skip = self.skip
        return self.collated(
            self.training_batches(self.epoch, skip) if self.shuffle else self.validation_batches(), skip
        )

    def collated(self, batches: Iterator[tuple[int, list[Item]]], skip: int) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for number, batch in batches:
            if (number - skip) % workers == worker:
                yield self.collate(batch)

    def training_batches(self, epoch: int, skip: int) -> Iterator[tuple[int, list[Item]]]:
        full_steps = self.full_steps()
        first_pool = skip // self.accumulate // self.pool_steps  # earlier pools were trained on: not even read
        for pool_start in range(first_pool * self.pool_steps, full_steps, self.pool_steps):
            steps = self.pool(epoch, pool_start, min(pool_start + self.pool_steps, full_steps))
            for step, items in enumerate(steps, start=pool_start):
                for k in range(self.accumulate):
                    number = step * self.accumulate + k
                    if number >= skip:
                        j = k * self.world_size + self.rank
                        yield number, items[j * self.batch_size : (j + 1) * self.batch_size]
        share = self.tail_share()
        if share:
            start = full_steps * self.global_batch
            tail = self.by_length(self.items(epoch, start, start + share * self.world_size))
            mine = tail[self.rank :: self.world_size]
            for k in range(math.ceil(share / self.batch_size)):
                number = full_steps * self.accumulate + k
                if number >= skip:
                    yield number, mine[k * self.batch_size : (k + 1) * self.batch_size]

    def validation_batches(self) -> Iterator[tuple[int, list[Item]]]:
        total = len(self.reader)
        start = self.rank * total // self.world_size
        stop = (self.rank + 1) * total // self.world_size
        order = np.arange(len(self.reader.sizes))
        for number, first in enumerate(range(start, stop, self.batch_size)):
            rows = self.locate(range(first, min(first + self.batch_size, stop)), order)
            yield number, [self.item(where) for where in rows]

    def pool(self, epoch: int, first_step: int, stop_step: int) -> list[list[Item]]:
        """The steps ``first_step`` to ``stop_step`` of the epoch, each the pairs of one global batch."""
        items = self.by_length(self.items(epoch, first_step * self.global_batch, stop_step * self.global_batch))
        steps = [items[i : i + self.global_batch] for i in range(0, len(items), self.global_batch)]
        order = self.rng(epoch, 1, first_step).permutation(len(steps))
        return [steps[i] for i in order]

    def by_length(self, items: list[Item]) -> list[Item]:
        if not self.group_by_length:
            return items
        return sorted(items, key=lambda item: len(item[1]) + len(item[2]))

    def items(self, epoch: int, start: int, stop: int) -> list[Item]:
        """Pairs ``start`` to ``stop`` of the epoch's order."""
        sizes = np.array(self.reader.sizes)
        order = self.rng(epoch, 2).permutation(len(sizes))
        rows: dict[int, np.ndarray] = {}
        items = []
        for shard, row in self.locate(range(start, stop), order):
            if shard not in rows:
                rows[shard] = self.rng(epoch, 3, shard).permutation(sizes[shard])
            items.append(self.item((shard, int(rows[shard][row]))))
        return items

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
    checkpoint left it (:class:`data.resumable.EpochPosition`) by skipping batches without reading them.

    The position resumed is that of the last optimizer step: batches accumulated after it never reached the
    weights, so they are trained again. A checkpoint of another world size or accumulation resumes there too,
    with the same global batch, and the steps left are shared among the processes of this run.
    """

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

    def state_dict(self) -> dict[str, int]:
        return {
            **super().state_dict(),
            "global_batch": self.dataset.global_batch,
            "accumulate": self.dataset.accumulate,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["batches_done"] >= state["batches_in_epoch"]:
            return
        global_batch = state.get("global_batch", self.dataset.global_batch)
        if global_batch != self.dataset.global_batch:
            data = self.dataset
            raise MisconfigurationException(
                f"The checkpoint stopped in the middle of an epoch with a global batch of {global_batch} pairs per "
                f"optimizer step; this run's is {data.global_batch} (data.batch_size {data.batch_size} x "
                f"{data.world_size} processes x {data.accumulate} accumulated batches), so the pairs the epoch has "
                f"left cannot be continued exactly. Keep the global batch: declare it with training.GlobalBatch "
                f"in the config (size: {global_batch}), which sets the batch size or the accumulation for any number "
                "of processes."
            )
        steps = state["batches_done"] // state.get("accumulate", self.dataset.accumulate)
        batches_done = steps * self.dataset.accumulate
        move_epoch_position(self.trainer, batches_done - state["batches_done"])
        self.resume_at(batches_done)

    def resume_at(self, batches_done: int) -> None:
        self.dataset.skip = batches_done
