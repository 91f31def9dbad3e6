"""A training DataLoader that continues a partly trained epoch exactly where a checkpoint left it."""

import itertools
import os
from collections.abc import Iterator, Sized
from typing import Any

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, DistributedSampler


class ResumableSampler(DistributedSampler):
    """A DistributedSampler (for one process too) that can leave out the part of an epoch a resumed run already
    trained on.

    The order depends only on the seed and the epoch, never on the global random state, so an interrupted
    run and an uninterrupted one draw the same samples in the same order. Rank ``r`` of ``W`` takes every
    ``W``-th sample from position ``r``, so the samples of the epoch's first batches are the start of its order,
    whatever the number of processes: a run resumed on another number of processes shares the rest anew.
    """

    def __init__(self, dataset: Sized, batch_size: int, num_replicas: int, rank: int, shuffle: bool, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.batch_size = batch_size
        self.skip_batches = 0
        self.skip_samples = 0  # of the epoch's order, trained by a run with another number of processes

    def __iter__(self) -> Iterator[int]:
        skip_batches, skip_samples = self.skip_batches, self.skip_samples
        self.skip_batches = self.skip_samples = 0
        if not skip_samples:
            return itertools.islice(super().__iter__(), skip_batches * self.batch_size, None)
        # The epoch's whole order is that of the same sampler for one process.
        whole = DistributedSampler(self.dataset, num_replicas=1, rank=0, shuffle=self.shuffle, seed=self.seed)
        whole.set_epoch(self.epoch)
        rest = list(whole)[skip_samples:]
        # Evened out with samples from its start, as DistributedSampler does.
        rest += [rest[i % len(rest)] for i in range(-len(rest) % self.num_replicas)]
        return iter(rest[self.rank :: self.num_replicas])


class EpochPosition:
    """A training loader's place in the epoch, in checkpoints: the number of batches the trainer finished in
    the current epoch (the trainer's count, not the loader's, which runs a batch ahead).

    Lightning stores ``state_dict()`` in every checkpoint and passes it to ``load_state_dict()`` before the
    resumed epoch starts; ``resume_at`` then makes the epoch leave out that many batches, so no sample is seen
    twice or skipped. A checkpoint from the end of an epoch leaves nothing out.
    """

    trainer: Trainer | None

    def state_dict(self) -> dict[str, int]:
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        return {"batches_done": progress.processed, "batches_in_epoch": int(self.trainer.num_training_batches)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["batches_done"] < state["batches_in_epoch"]:
            self.resume_at(state["batches_done"])

    def resume_at(self, batches_done: int) -> None:
        raise NotImplementedError


class ResumableDataLoader(EpochPosition, DataLoader):
    """Shuffles and shards like Lightning's DistributedSampler, and keeps its place in the epoch in checkpoints.

    A resumed epoch (:class:`EpochPosition`) skips the batches already trained as indices, without loading them.
    Resumed with another number of processes or batch size, it shares the samples the epoch has left among the
    processes (:class:`ResumableSampler`); as in Lightning's DistributedSampler, at most one sample per process is
    repeated to even them out.

    Starting an epoch draws no number from the global generator (a DataLoader normally draws its workers'
    seed from it), so a resumed run's dropout masks continue exactly where the checkpoint left them.
    """

    def __init__(self, dataset: Sized, batch_size: int, trainer: Trainer | None, shuffle: bool = True, **kwargs: Any):
        world_size, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
        # The seed Lightning gives its own DistributedSampler, so the order matches a plain DataLoader under DDP.
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        sampler = ResumableSampler(dataset, batch_size, world_size, rank, shuffle, seed)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator(), **kwargs)
        self.trainer = trainer

    def __iter__(self) -> Iterator[Any]:
        self.generator.manual_seed(self.sampler.seed + self.sampler.epoch)
        return super().__iter__()

    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "batch_size": self.batch_size, "world_size": self.sampler.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        split = state.get("batch_size", self.batch_size), state.get("world_size", self.sampler.num_replicas)
        if state["batches_done"] < state["batches_in_epoch"] and split != (self.batch_size, self.sampler.num_replicas):
            self.sampler.skip_samples = state["batches_done"] * split[0] * split[1]
        else:
            super().load_state_dict(state)

    def resume_at(self, batches_done: int) -> None:
        self.sampler.skip_batches = batches_done


def move_epoch_position(trainer: Trainer | None, batches: int) -> None:
    """Move the trainer's count of the current epoch's batches by ``batches``, keeping its stages in step.

    Lightning counts an epoch's batches in four stages (ready, started, processed, completed) and decides from
    them when to step the optimizer; a loader that resumes at another batch than the checkpoint's count moves
    all of them alike.
    """
    if trainer is None or batches == 0:
        return
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for tracker in (progress.current, progress.total):
        for stage in ("ready", "started", "processed", "completed"):
            setattr(tracker, stage, getattr(tracker, stage) + batches)
