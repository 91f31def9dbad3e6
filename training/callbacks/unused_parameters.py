"""Stop a DDP run in its first training step, with the parameters named, when some of them got no gradient."""

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.parallel import DistributedDataParallel


class UnusedParameterCheck(Callback):
    """Checks every backward pass of the first training step: each parameter DDP reduces must get a gradient.

    DDP with ``find_unused_parameters: false`` waits for a gradient of every parameter that required one when it
    wrapped the model; when one gets none in a backward pass, the next backward pass fails with "Expected to have
    finished reduction in the prior iteration", which Lightning rewords without naming any parameter. This check
    stops before that, in one paragraph that names the parameters and the fix. Under manual optimization a step
    has a backward pass per ``manual_backward``: a GAN's generator pass leaves the discriminator without a
    gradient (``toggle_optimizer`` even turns its ``requires_grad`` off), and the discriminator's pass the generator.

    It does nothing without DDP, with ``find_unused_parameters: true`` or with ``static_graph: true``, and costs a
    hook per parameter for the first step only. A parameter that goes unused only in later steps still meets DDP's
    error.
    """

    def __init__(self) -> None:
        self.reduced: dict[str, torch.nn.Parameter] = {}  # what DDP waits for, while the first step runs
        self.received: set[str] = set()
        self.hooks: list[Any] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        ddp = trainer.model
        # With static_graph, DDP learns in the first step which parameters go unused.
        if not isinstance(ddp, DistributedDataParallel) or ddp.find_unused_parameters or ddp.static_graph:
            return
        # DDP wrapped the model before training started: these required a gradient then, and nothing toggled them.
        ignored = set(ddp.parameters_to_ignore)
        self.reduced = {n: p for n, p in pl_module.named_parameters() if p.requires_grad and n not in ignored}

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self.received = set()
        for name, parameter in self.reduced.items():
            if parameter.requires_grad:  # one toggled off gets no gradient, and takes no hook
                hook = parameter.register_post_accumulate_grad_hook(lambda _, name=name: self.received.add(name))
                self.hooks.append(hook)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        unused = [name for name in self.reduced if name not in self.received]
        if not unused:
            return
        self.reduced = {}
        manual = "" if pl_module.automatic_optimization else " (a manual_backward of a module that optimizes manually)"
        # Quoting DDP's sentence whole would make Lightning replace this message with its own.
        raise MisconfigurationException(
            f"{len(unused)} parameter(s) got no gradient in a backward pass of the first training step{manual}: "
            f"{', '.join(unused)}. DDP with find_unused_parameters=false needs a gradient for every parameter in "
            'every backward pass, and would stop at the next one with "Expected to have finished reduction ...". '
            "Let DDP look for unused parameters in every backward pass (slower): add -c configs/find_unused.yaml "
            "after -c configs/ddp.yaml, or --trainer.strategy.init_args.find_unused_parameters=true; or make these "
            "parameters part of every loss, or remove them from the model."
        )

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self.reduced = {}  # the first step is over
