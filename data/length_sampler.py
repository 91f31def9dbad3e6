"""Training batches of pairs of similar length (``data.group_by_length``), so they carry less padding."""

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import BatchSampler, Sampler


class LengthGroupedBatchSampler(BatchSampler):
    """Batches of similar length: the indices ``sampler`` yields are cut into pools of ``pool_batches`` batches,
    each pool is sorted by ``lengths`` and cut into batches, and the order of all batches is shuffled.

    Under DDP, Lightning replaces ``sampler`` with a DistributedSampler, so each rank groups its own
    shard and every rank gets the same number of batches.
    """

    def __init__(
        self, sampler: Sampler[int], batch_size: int, drop_last: bool, lengths: Sequence[int], pool_batches: int = 50
    ) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.lengths = lengths
        self.pool_batches = pool_batches

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(self.sampler)
        pool_size = self.batch_size * self.pool_batches
        batches = []
        for start in range(0, len(indices), pool_size):
            pool = sorted(indices[start : start + pool_size], key=self.lengths.__getitem__)
            batches += [pool[i : i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
        if self.drop_last and len(batches[-1]) < self.batch_size:
            batches.pop()
        # The global generator, seeded by seed_everything, so runs repeat and epochs differ.
        for i in torch.randperm(len(batches)).tolist():
            yield batches[i]
