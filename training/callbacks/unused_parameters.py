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
        named = f"{len(unused)} parameter(s) got no gradient in a backward pass of the first training step{manual}"
        ddp_needs = (
            "DDP with find_unused_parameters=false needs a gradient for every parameter in every backward pass, and "
            'would stop at the next one with "Expected to have finished reduction ...".'
        )
        if copies := copies_of_others(pl_module, unused):
            which = ", ".join(f"{copy} (a copy of {original})" for copy, original in copies.items())
            calls = ", ".join(f"self.{copy}.requires_grad_(False)" for copy in copies)
            raise MisconfigurationException(
                f"{named}: every parameter of {which}. {ddp_needs} A copy that training never "
                "gives a gradient, such as an average of the weights (EMA, AveragedModel) or a frozen teacher, takes "
                f"no part in DDP once it requires none: call {calls} in the module's __init__ "
                "(AveragedModel.update_parameters updates it without gradients), or keep "
                "the average with Lightning 2.6's WeightAveraging callback instead of a submodule."
            )
        raise MisconfigurationException(
            f"{named}: {', '.join(unused)}. {ddp_needs} Let DDP look for unused parameters in every backward pass "
            "(slower): add -c configs/find_unused.yaml after -c configs/ddp.yaml, or "
            "--trainer.strategy.init_args.find_unused_parameters=true; or make these parameters part of every loss, "
            "or remove them from the model."
        )

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self.reduced = {}  # the first step is over


def copies_of_others(module: torch.nn.Module, unused: list[str]) -> dict[str, str]:
    """Submodule -> the submodule it copies, where ``unused`` is exactly the parameters of such copies: submodules of
    two layers or more whose parameters have the shapes, in order, of another's outside them
    (``copy.deepcopy(self.net)``, ``AveragedModel(self.net)``). Empty where any unused parameter is of something else;
    a single layer (an unused head) counts as no copy, however its shapes fall."""
    shapes = {name: tuple(p.shape for p in sub.parameters()) for name, sub in module.named_modules() if name}
    copies: dict[str, str] = {}
    left = set(unused)
    for name, signature in shapes.items():  # a submodule comes before those inside it
        submodule = module.get_submodule(name)
        own = {f"{name}.{parameter}" for parameter, _ in submodule.named_parameters()}
        layers = sum(1 for layer in submodule.modules() if next(layer.parameters(recurse=False), None) is not None)
        if layers < 2 or not own <= left or any(name.startswith(f"{copy}.") for copy in copies):
            continue
        original = next(
            (other for other, theirs in shapes.items() if theirs == signature and not related(other, name)), None
        )
        if original is not None:
            copies[name] = original
            left -= own
    return copies if not left else {}


def related(one: str, other: str) -> bool:
    """Whether submodule ``one`` is ``other``, inside it, or holds it."""
    return one == other or one.startswith(f"{other}.") or other.startswith(f"{one}.")
