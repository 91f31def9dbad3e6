"""Stop a DDP run at its first backward pass, with the parameters named, when some of them got no gradient."""

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel


class UnusedParameterCheck(Callback):
    """Checks once, after the first backward pass, that every trainable parameter got a gradient.

    DDP with ``find_unused_parameters: false`` waits for a gradient of every parameter; when one gets
    none, the next step fails with "Expected to have finished reduction in the prior iteration", which
    Lightning rewords without naming any parameter. This check stops one step earlier, names the
    parameters and gives the fix. It does nothing without DDP, with ``find_unused_parameters: true`` or
    with ``static_graph: true``, and costs one pass over the parameters, once. A parameter that goes
    unused only in later steps still meets DDP's error.
    """

    def __init__(self) -> None:
        self.checked = False

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.checked:
            return
        self.checked = True
        ddp = trainer.model
        # With static_graph, DDP learns in the first step which parameters go unused.
        if not isinstance(ddp, DistributedDataParallel) or ddp.find_unused_parameters or ddp.static_graph:
            return
        unused = [name for name, p in pl_module.named_parameters() if p.requires_grad and p.grad is None]
        if unused:
            # Quoting DDP's sentence whole would make Lightning replace this message with its own.
            raise RuntimeError(
                f"{len(unused)} parameter(s) got no gradient in the first training step: {', '.join(unused)}. "
                "DDP with find_unused_parameters=false needs a gradient for every parameter in every step, and "
                'would stop at the next step with "Expected to have finished reduction ...". '
                "Make these parameters part of the loss, remove them from the model, or let DDP look for unused "
                "parameters in every step (slower): add -c configs/find_unused.yaml, or "
                "--trainer.strategy.init_args.find_unused_parameters=true."
            )
