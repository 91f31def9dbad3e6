"""LightningCLI's ``--optimizer`` and ``--lr_scheduler``, for a module that leaves its optimizer to them.

Given these, LightningCLI builds the optimizer (and the scheduler, stepped every epoch) and replaces the module's
``configure_optimizers`` with its own. A module that has a ``configure_optimizers`` (each model of this template:
it takes its optimizer as its ``optimizer`` argument) would lose it with a warning only, and a scheduler without an
optimizer is dropped without a word; both are refused before anything starts, saying how that module chooses.
"""

import importlib
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden

from training.config.parser import accepted

EXAMPLE = "--optimizer=torch.optim.AdamW --optimizer.lr=0.001"


def optimizer_flags_problem(settings: dict[str, Any]) -> str | None:
    """Why the ``optimizer`` and ``lr_scheduler`` of ``settings`` (a subcommand's config) cannot apply, or None."""
    if settings.get("lr_scheduler") is None and settings.get("optimizer") is None:
        return None
    if settings.get("optimizer") is None:
        return (
            f"--lr_scheduler schedules the optimizer that --optimizer builds, and no --optimizer is given: add one, "
            f"such as {EXAMPLE}, or leave out --lr_scheduler."
        )
    model = (settings.get("model") or {}).get("class_path", "")
    module, _, name = model.rpartition(".")
    cls = getattr(importlib.import_module(module), name) if module else None
    if not (isinstance(cls, type) and is_overridden("configure_optimizers", cls, LightningModule)):
        return None
    if "optimizer" in accepted(model):
        way = (
            "its optimizer argument: --model.init_args.optimizer=torch.optim.SGD "
            "--model.init_args.optimizer.init_args.lr=0.1 on the command line, or model.init_args.optimizer in YAML"
        )
    else:
        way = "its own configure_optimizers: change the optimizer there"
    return (
        f"--optimizer and --lr_scheduler build the optimizer of a module without a configure_optimizers of its own, "
        f"but {model} has one, which they would replace; it chooses its optimizer with {way}."
    )
