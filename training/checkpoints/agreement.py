"""Every process of a job loads one and the same checkpoint, which fits the model, before DDP copies global rank
0's weights to the others: each process resolved ``ckpt_path`` (``last`` included) on its own filesystem, and a
process that stopped alone on a checkpoint it cannot load would leave the others waiting in a collective."""

import os
from collections.abc import Callable
from typing import Any

import torch

from training.job.roster import FIXES


def loads_problem(everyone: list[tuple[str, str, str]], ckpt_path: str | None, fitting: bool = True) -> str | None:
    """The paragraph when the processes' ``(where, checkpoint it loads, its problem)`` disagree or one checkpoint
    does not fit the model, or None; ``fitting``: for fit, which resumes, not for validate, test or predict."""
    loads = {where: fact for where, fact, _ in everyone}
    if len(set(loads.values())) > 1:
        shown = ", ".join(f"{where} loads {fact}" for where, fact in loads.items())
        return (
            f"the job cannot start, its processes load different checkpoints: {shown}. To fix: {FIXES['checkpoint']}."
        )
    if problem := next((problem for _, _, problem in everyone if problem), ""):
        fix = (
            "To resume, restore the model settings of that run; to train the changed model, start a new run with "
            "RUN_ID=<new id>."
            if fitting
            else "To evaluate it, restore the model settings of that run, or give --ckpt_path a checkpoint of the "
            "model the config builds now."
        )
        return f"the checkpoint {ckpt_path} holds another model than the config builds now ({problem}). {fix}"
    return None


def without_compile(model: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``saved`` under the key names of ``model`` where the two differ only by torch.compile's ``_orig_mod.`` (a
    checkpoint of the compiled module into the same module uncompiled, or back); else ``saved`` as it is."""
    plain = {key.replace("_orig_mod.", ""): key for key in model}
    if model.keys() == saved.keys() or plain.keys() != {key.replace("_orig_mod.", "") for key in saved}:
        return saved
    return {plain[key.replace("_orig_mod.", "")]: value for key, value in saved.items()}


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


def given_settings_problem(ckpt_path: str | None, given_model: Callable[[], dict[str, Any]]) -> str | None:
    """The paragraph when the model settings given (``given_model()``: its class_path and init_args, as given in the
    config files and on the command line) differ from the hyperparameters of the checkpoint file ``ckpt_path``, or
    None. ``given_model``, a parse of its own, is called only where ``ckpt_path`` is a file.

    LightningCLI builds the model from a checkpoint file's hyperparameters (its class included) over what the config
    gives: another class or other settings given for it would be dropped without a word, and the run would train or
    evaluate the checkpoint's model instead of the one asked for.
    """
    if not ckpt_path or not os.path.isfile(ckpt_path) or not (model := given_model()):
        return None
    try:
        saved = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True).get("hyper_parameters") or {}
    except Exception:  # not a checkpoint: the checks of its contents name what is wrong with it
        return None
    given_class = model.get("class_path")
    saved_class = saved.get("_class_path")
    if saved_class and given_class and saved_class != given_class:
        return (
            f"--ckpt_path {ckpt_path} holds a {saved_class}, and the config gives model.class_path={given_class}: "
            f"LightningCLI would build the checkpoint's {saved_class} and drop the model given. Give a checkpoint of "
            f"{given_class}, or --model {saved_class} to use this one."
        )
    differ = [
        f"model.init_args.{key}={value!r} is given, the checkpoint has {saved[key]!r}"
        for key, value in (model.get("init_args") or {}).items()
        if key in saved and not isinstance(value, dict) and as_list(value) != as_list(saved[key])
    ]
    if not differ:
        return None
    return (
        f"--ckpt_path {ckpt_path} holds a model built with other settings than those given ({'; '.join(differ)}): "
        "LightningCLI would build the model the checkpoint describes and drop the settings given. Leave them out to "
        "use the checkpoint's model; to train the changed model, start a new run with RUN_ID=<new id>."
    )


def as_list(value: Any) -> Any:
    """A tuple as a list: a checkpoint may hold as a tuple what the config gives as a list."""
    return list(value) if isinstance(value, tuple) else value
