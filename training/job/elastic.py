"""Elastic jobs: a node count that may change between restarts, and the same training at every count.

Under torchrun with a range of nodes (``--nnodes=MIN:MAX``; the launcher's ``MIN_NODES``), the rendezvous restarts
the workers with the nodes it has after one is lost, and with one more when a node comes back. The strategy's
``min_nodes`` accepts every count of the range (:func:`nodes_present`); :class:`GlobalBatch` keeps the pairs of
an optimizer step the same at every count, so the data can go on where the last checkpoint left it
(``data/streaming.py``) and a schedule by step stays what it was.
"""

from typing import Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.environments import ClusterEnvironment, TorchElasticEnvironment
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


def nodes_present(min_nodes: int | None, num_nodes: int, environment: ClusterEnvironment | None, processes: int) -> int:
    """The nodes this attempt of the job has: ``num_nodes`` (the config's, the most there can be) unless the job is
    elastic, when torchrun's world size says how many of ``min_nodes`` to ``num_nodes`` joined."""
    if min_nodes is None:
        return num_nodes
    if not 1 <= min_nodes <= num_nodes:
        raise MisconfigurationException(
            f"strategy min_nodes={min_nodes} must be between 1 and trainer.num_nodes={num_nodes}, the most nodes "
            "the job may have. Set MIN_NODES (or min_nodes in the config) to the fewest nodes the job may go on with."
        )
    if not isinstance(environment, TorchElasticEnvironment):
        rank_zero_warn(
            f"strategy min_nodes={min_nodes} makes a job elastic under torchrun only (LAUNCHER=torchrun); this "
            f"run has a fixed {num_nodes} node(s)."
        )
        return num_nodes
    nodes, rest = divmod(environment.world_size(), processes)
    if rest or not min_nodes <= nodes <= num_nodes:
        raise MisconfigurationException(
            f"torchrun started {environment.world_size()} processes, which is not {processes} per node on "
            f"{min_nodes} to {num_nodes} nodes (strategy min_nodes to trainer.num_nodes). Start every node with "
            "the same GPUS and the same MIN_NODES and NUM_NODES."
        )
    return nodes


class GlobalBatch(Callback):
    """Keeps ``size`` samples per optimizer step, over all processes, whatever number of processes the job has.

    Before training, it sets the DataModule's ``batch_size`` (per process) or the trainer's
    ``accumulate_grad_batches`` so that processes x batch_size x accumulate_grad_batches = ``size``. An elastic
    job (strategy ``min_nodes``) is checked for every node count it may run with, so a size that one of them
    cannot keep stops the job when it starts, not after it lost a node.

    Args:
        size: samples per optimizer step over all processes.
        adapt: what changes with the number of processes: ``batch_size`` (``accumulate_grad_batches`` stays) or
            ``accumulate`` (``data.batch_size`` stays).
    """

    def __init__(self, size: int, adapt: Literal["batch_size", "accumulate"] = "batch_size") -> None:
        if size < 1:
            raise ValueError(f"training.GlobalBatch: size must be a positive integer, got {size}")
        self.size = size
        self.adapt = adapt

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        most = getattr(strategy, "configured_nodes", trainer.num_nodes)
        counts = range(getattr(strategy, "min_nodes", None) or most, most + 1)
        batch_size = lightning_getattr(pl_module, "batch_size")
        unkept = [n for n in counts if self.split(n * trainer.num_devices, batch_size, trainer) is None]
        if unkept:
            nodes = ", ".join(map(str, unkept))
            raise MisconfigurationException(
                f"training.GlobalBatch: a global batch of {self.size} cannot be kept on {nodes} node(s) of "
                f"{trainer.num_devices} process(es) with adapt: {self.adapt} ({self.rule(batch_size, trainer)}). "
                "Choose a size that every process count of the job divides, or the other adapt."
            )
        per_process = self.split(trainer.world_size, batch_size, trainer)
        if self.adapt == "batch_size":
            lightning_setattr(pl_module, "batch_size", per_process)
        else:
            trainer.accumulate_grad_batches = per_process
        rank_zero_info(
            f"Global batch {self.size}: {trainer.world_size} process(es) x batch_size "
            f"{lightning_getattr(pl_module, 'batch_size')} x {trainer.accumulate_grad_batches} accumulated"
        )

    def split(self, processes: int, batch_size: int, trainer: Trainer) -> int | None:
        """The batch size (or accumulation) that keeps the global batch on ``processes``; None when none does."""
        other = trainer.accumulate_grad_batches if self.adapt == "batch_size" else batch_size
        value, rest = divmod(self.size, processes * other)
        return value if value and not rest else None

    def rule(self, batch_size: int, trainer: Trainer) -> str:
        if self.adapt == "batch_size":
            accumulate = trainer.accumulate_grad_batches
            return f"the batch size is {self.size} / (processes x accumulate_grad_batches {accumulate})"
        return f"the accumulation is {self.size} / (processes x batch_size {batch_size})"
