"""Settings that each work alone but not together, found before anything starts, naming where each was set."""

import importlib
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.strategies import FSDPStrategy


def combination_problem(config: dict[str, Any]) -> str | None:
    """The paragraph explaining why the settings of ``config`` (a subcommand's, as a dict) cannot combine, or None."""
    trainer = config.get("trainer") or {}
    clips_by_norm = trainer.get("gradient_clip_val") and trainer.get("gradient_clip_algorithm") in (None, "norm")
    if _is_fsdp(trainer.get("strategy")) and clips_by_norm:
        files = [str(path) for path in config.get("config") or []]
        return (
            f"{_origin('trainer.strategy', files)} shards the model with FSDP, and "
            f"{_origin('trainer.gradient_clip_val', files)} clips gradients by their norm: Lightning 2.6 cannot "
            "clip by norm under FSDP (each process holds only a shard of the gradients) and would stop at the first "
            "optimizer step. Clip by value (--trainer.gradient_clip_algorithm=value), drop the clipping "
            "(--trainer.gradient_clip_val=null), or train with DDP (leave out the FSDP config)."
        )
    return None


def _is_fsdp(strategy: Any) -> bool:
    if isinstance(strategy, str):
        return strategy.startswith("fsdp")
    module, _, name = str((strategy or {}).get("class_path")).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, FSDPStrategy)


def _origin(key: str, files: list[str]) -> str:
    """The last config file that sets the dotted ``key`` (later files override earlier ones), else the command line."""
    for file in reversed(files):
        node: Any = yaml.safe_load(Path(file).read_text())
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return f"{file} ({key})"
    return f"--{key} on the command line"
