"""Every process of a job loads one and the same checkpoint, which fits the model, before DDP copies global rank
0's weights to the others: each process resolved ``ckpt_path`` (``last`` included) on its own filesystem, and a
process that stopped alone on a checkpoint it cannot load would leave the others waiting in a collective."""

import torch

from training.job.startup import FIXES


def loads_problem(everyone: list[tuple[str, str, str]], ckpt_path: str | None) -> str | None:
    """The paragraph when the processes' ``(where, checkpoint it loads, its problem)`` disagree or one checkpoint
    does not fit the model, or None."""
    loads = {where: fact for where, fact, _ in everyone}
    if len(set(loads.values())) > 1:
        shown = ", ".join(f"{where} loads {fact}" for where, fact in loads.items())
        return (
            f"the job cannot start, its processes load different checkpoints: {shown}. To fix: {FIXES['checkpoint']}."
        )
    if problem := next((problem for _, _, problem in everyone if problem), ""):
        return (
            f"the checkpoint {ckpt_path} holds another model than the config builds now ({problem}). "
            "To resume, restore the model settings of that run; to train the changed model, start a new run "
            "with RUN_ID=<new id>."
        )
    return None


def model_mismatch(model: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> str:
    """What keeps ``saved`` (a checkpoint's state dict) from loading into ``model``'s, or "" if nothing does."""
    missing = sorted(model.keys() - saved.keys())
    unexpected = sorted(saved.keys() - model.keys())
    reshaped = [
        f"{key} {tuple(saved[key].shape)} in the checkpoint, {tuple(model[key].shape)} now"
        for key in sorted(model.keys() & saved.keys())
        if model[key].shape != saved[key].shape
    ]
    parts = [
        f"{what}: {', '.join(keys[:3])}{f' and {len(keys) - 3} more' if len(keys) > 3 else ''}"
        for what, keys in (("missing", missing), ("unexpected", unexpected), ("other shape", reshaped))
        if keys
    ]
    return "; ".join(parts)
