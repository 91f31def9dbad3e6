"""Validation and test that count each sample once on several processes.

Lightning gives each process of a DDP job an equal share of an evaluation set by padding the shares with repeats of
the first samples (torch's DistributedSampler): 11 samples on 2 processes are evaluated as 12, and every metric
counts one of them twice. Here an evaluation's padded DistributedSampler loses its padding (shares of 6 and 5) where
every process still runs the same number of batches, so a collective inside a step (``self.log`` with ``sync_dist``,
a metric's ``dist_sync_on_step``, ``self.all_gather``) still meets its peers; ``self.log``'s epoch figures (a sum
and a count, each averaged over the processes: the count in floating point here, which Lightning truncates) and
torchmetrics then count each sample once. Where the shares would need different numbers of batches (the last global
batch has fewer samples than there are processes), the padded shares stay and one line says so. ``self.all_gather``
of tensors whose first dimension follows the samples (a last batch, or all an epoch kept) pads the shorter ones with
a repeat of their last row, as the sampler would have, so the gather works as before and says once that a figure
computed from it counts those rows twice.

Predict needs none of this: Lightning's predict shares its data without repeats already."""

import warnings
from typing import Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

EVALUATING = (RunningStage.SANITY_CHECKING, RunningStage.VALIDATING, RunningStage.TESTING)
# The samplers Lightning puts in an evaluation's loader: torch's, or its own around a sampler of the user's. A subclass
# of the user's may deal its indices another way.
SHARED = (DistributedSampler, DistributedSamplerWrapper)


def stage_name(stage: RunningStage) -> str:
    return "test" if stage == RunningStage.TESTING else "validation"


def shares(samples: int, processes: int) -> list[int]:
    """Each process's number of samples when ``samples`` are dealt out without repeats, in rank order."""
    return [len(range(rank, samples, processes)) for rank in range(processes)]


def batches(share: int, loader: DataLoader) -> int:
    batch_size = loader.batch_size or 1  # None: the loader yields one sample at a time
    return share // batch_size if loader.drop_last else -(-share // batch_size)


def padding_stays(stage: str, samples: int, processes: int, loader: DataLoader) -> str:
    """The line for an evaluation whose unpadded shares would need different numbers of batches."""
    dealt = sorted(set(shares(samples, processes)), reverse=True)
    repeats = -samples % processes
    return (
        f"{stage}: {samples} samples on {processes} processes in batches of {loader.batch_size or 1} cannot be shared "
        f"without repeats so that every process runs as many batches as the others (shares of "
        f"{' and '.join(map(str, dealt))} samples), which a collective inside a step needs; so Lightning's padded "
        f"shares stay, and {repeats} sample{' is' if repeats == 1 else 's are'} evaluated and counted twice. For "
        f"exact figures, choose a batch size that gives every share the same number of batches, or run the {stage} "
        "on one process."
    )


def quiet_lightnings_advice() -> None:
    """Leave out Lightning's advice to test on one device so that each sample counts once: here it does."""
    warnings.filterwarnings(
        "ignore", message=r"Using `DistributedSampler` with the dataloaders\. During `trainer\.test"
    )


class ExactEvaluation:
    """A strategy's part that shares an evaluation set without repeats (the module's docstring says how).

    ``exact_evaluation`` (the strategy's argument): False keeps Lightning's padded shares."""

    exact_evaluation: bool
    told_of_padded_gathers = False

    def say(self, line: str) -> None:
        if self.is_global_zero:
            tqdm.write(line)  # on a line of its own above the progress bar, which the line comes in the middle of

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        stage = self.lightning_module.trainer.state.stage
        sampler = getattr(dataloader, "sampler", None)
        padded = type(sampler) in SHARED and not sampler.drop_last
        if not (self.exact_evaluation and stage in EVALUATING and padded and sampler.total_size > len(sampler.dataset)):
            return dataloader
        samples, processes = len(sampler.dataset), sampler.num_replicas
        dealt = shares(samples, processes)
        if len({batches(share, dataloader) for share in dealt}) > 1:
            self.say(padding_stays(stage_name(stage), samples, processes, dataloader))
            return dataloader
        # DistributedSampler deals out total_size indices, num_samples to each process: the set's own size, no repeats.
        sampler.total_size = samples
        sampler.num_samples = dealt[sampler.rank]
        return dataloader

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Lightning's mean of an integer tensor comes back truncated (divided in place on gloo, NCCL's average of
        # integers): the sample counts behind self.log's epoch mean, 6 and 5 on two processes, would average to 5,
        # not 5.5, and the mean of 11 numbers come out 10% high.
        if isinstance(tensor, Tensor) and not tensor.is_floating_point() and reduce_op in ("mean", "avg"):
            tensor = tensor.double()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        stage = self.lightning_module.trainer.state.stage
        if not (self.exact_evaluation and stage in EVALUATING and self.world_size > 1 and tensor.dim() > 0):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        rows = super().all_gather(torch.tensor(tensor.shape[0], device=tensor.device), group=group)
        longest, shortest = int(rows.max()), int(rows.min())
        if shortest < longest:
            if not self.told_of_padded_gathers:
                self.say(
                    f"{stage_name(stage)}: self.all_gather got {longest} rows from "
                    f"some processes and {shortest} from others, as each process evaluates its own share of the data "
                    "once; the shorter ones were padded with a repeat of their last row, as Lightning pads the data "
                    "itself, so a figure computed from the gathered tensor counts those rows twice. self.log and "
                    "torchmetrics count each sample once."
                )
                self.told_of_padded_gathers = True
            if 0 < tensor.shape[0] < longest:  # an empty one fails to gather, as it does in Lightning
                tensor = torch.cat([tensor, tensor[-1:].expand(longest - tensor.shape[0], *tensor.shape[1:])])
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)
