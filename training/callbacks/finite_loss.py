"""Stop a run whose loss became NaN or inf, before any checkpoint holds what the step after it makes of the weights."""

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from training.checkpoints.last import LastCheckpoint
from training.private_api import last_saved_step

FIXES = (
    "Try a lower learning rate, gradient clipping (--trainer.gradient_clip_val=1.0), bf16 in place of fp16, or look "
    "for bad values in the data of that step; to leave such steps out instead, set non_finite: skip on the "
    "training.FiniteLoss entry of trainer.callbacks."
)
MOST_HELD = 1000  # losses a process holds between checks, whatever log_every_n_steps


class NonFiniteError(RuntimeError):
    """A loss or weights that became NaN or inf; its message is the paragraph that says where and what to do."""


class FiniteLoss(Callback):
    """Keeps a run's checkpoints finite, and stops it where its loss stops being so.

    With ``non_finite: stop``, each process keeps its losses on the device (no wait for the GPU); every
    ``log_every_n_steps`` batches (1000 at most), and before every checkpoint is written, the processes compare where
    their first NaN or inf loss was (one all-reduce of two numbers a process), and all stop together, in one
    paragraph naming the step, the ranks and the last checkpoint that is still finite, from which the same command
    resumes. A checkpoint is never written with NaN or inf weights: the check before a save covers the weights too.

    With ``non_finite: skip``, an optimizer step whose gradients hold NaN or inf is left out (the optimizer leaves a
    parameter without a gradient as it is) and the run goes on: some mixed-precision and large-model recipes
    expect the occasional bad step. It waits for the GPU once a step, to read whether every gradient is finite.

    Args:
        non_finite: ``stop`` the run, or ``skip`` the optimizer step, of a loss that is NaN or inf.
    """

    def __init__(self, non_finite: Literal["stop", "skip"] = "stop") -> None:
        self.non_finite = non_finite
        # The losses since the last check with their steps, or None outside training: a step only keeps its loss on
        # the device, and the check looks at them all at once.
        self.held: list[tuple[int, torch.Tensor]] | None = None
        self.skipped = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.held = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if self.non_finite == "skip" or self.held is None or not isinstance(loss, torch.Tensor):
            return
        self.held.append((trainer.global_step, loss.detach()))
        # Every process holds as many losses as the others: they reach a check at the same batch.
        if (batch_idx + 1) % max(trainer.log_every_n_steps, 1) == 0 or len(self.held) >= MOST_HELD:
            self.check(trainer, pl_module)

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.non_finite != "skip":
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        finite = torch.stack([g.isfinite().all() for g in grads]).all() if grads else torch.tensor(True)
        # Every process decides alike, whichever part of the gradients it holds (FSDP shards them).
        if summed(finite.logical_not().int()).item() == 0:
            return
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                parameter.grad = None
        self.skipped += 1
        if self.skipped <= 10 or self.skipped % 100 == 0:
            rank_zero_warn(
                f"step {trainer.global_step}: the gradients held NaN or inf, so the optimizer step was left out "
                f"({self.skipped} step{'s' if self.skipped > 1 else ''} left out so far)."
            )

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == TrainerFn.FITTING and self.held is not None:  # validation's saves too
            self.check(trainer, pl_module, weights=True)

    def check(self, trainer: Trainer, pl_module: LightningModule, weights: bool = False) -> None:
        """Raise NonFiniteError on every process when any saw a non-finite loss (or, with ``weights``, holds
        non-finite weights)."""
        held, self.held = self.held or [], []
        finite = [p.isfinite().all() for p in pl_module.parameters()] if weights else []
        bad_weights = bool(finite) and not torch.stack(finite).all().item()
        # A row per process, each filling its own: summed over the processes, every one holds all of them. A row
        # holds the place of the first non-finite loss among the held ones (len(held): none), which names the same
        # step on every process, as they all hold the same steps.
        notes = torch.zeros((trainer.world_size, 2), dtype=torch.long, device=pl_module.device)
        notes[trainer.global_rank, 0] = first_non_finite([loss for _, loss in held])
        notes[trainer.global_rank, 1] = int(bad_weights)
        notes = [(held[place][0] if place < len(held) else -1, bad) for place, bad in summed(notes).tolist()]
        ranks = [str(rank) for rank, (step, _) in enumerate(notes) if step >= 0]
        if ranks:
            step = min(step for step, _ in notes if step >= 0)
            what = (
                f"the loss became NaN or inf at step {step}, on rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"
            )
        elif any(bad for _, bad in notes):
            what = f"the weights became NaN or inf by step {trainer.global_step} while the loss was finite"
        else:
            return
        raise NonFiniteError(
            f"{what}, so the run stopped: no checkpoint holds what came after. {kept(trainer)} {FIXES}"
        )


def first_non_finite(losses: list[torch.Tensor]) -> torch.Tensor | int:
    """The place of the first loss that is NaN or inf, ``len(losses)`` for none, computed on their device without
    waiting for it."""
    if not losses:
        return 0
    if all(loss.dim() == 0 for loss in losses):  # the usual scalar loss
        finite = torch.isfinite(torch.stack(losses))
    else:
        finite = torch.stack([torch.isfinite(loss).all() for loss in losses])
    places = torch.arange(len(losses), device=finite.device)
    return torch.where(finite, len(losses), places).min()


def summed(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the job's processes: one all-reduce (Lightning's ``strategy.reduce`` adds a barrier)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def kept(trainer: Trainer) -> str:
    """What the same command resumes from: the run's last.ckpt, written before the loss went wrong, or nothing."""
    last = next((c for c in trainer.callbacks if isinstance(c, LastCheckpoint)), trainer.checkpoint_callback)
    if isinstance(last, ModelCheckpoint) and last.last_model_path and last_saved_step(last) > 0:
        return (
            f"{last.last_model_path}, written at step {last_saved_step(last)}, holds the last finite weights: the "
            "same command resumes from it."
        )
    if trainer.ckpt_path:  # resumed, and nothing written since: what it resumed from was finite when written
        return f"{trainer.ckpt_path}, which this attempt resumed from, is finite: the same command resumes from it."
    return "No checkpoint was written before it: the same command starts the run anew."
