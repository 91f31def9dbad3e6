"""Trainer settings Lightning rejects only as it builds the Trainer or later, found before anything starts: settings
that each work alone but not together (naming where each was set), a ``trainer.devices`` it cannot parse, and
values it takes without a check and then fails on (or ignores)."""

import importlib
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator
from lightning.pytorch.strategies import FSDPStrategy

from training.config.loader import read_yaml

POSITIVE = re.compile(r"[1-9][0-9]*")
DEFAULT_WAITS = {"timeout": "0:30:00", "join_timeout": "0:10:00", "peer_timeout": "0:01:00"}
GPU_IDS = re.compile(r"[0-9]+(,[0-9]*)*")  # as Lightning reads "0,1": a trailing comma is allowed


def combination_problem(config: dict[str, Any]) -> str | None:
    """The paragraph explaining why the settings of ``config`` (a subcommand's, as a dict) cannot combine, or None."""
    trainer = config.get("trainer") or {}
    if problem := gpu_only_problem(config):
        return problem
    clips_by_norm = trainer.get("gradient_clip_val") and trainer.get("gradient_clip_algorithm") in (None, "norm")
    if _is_fsdp(trainer.get("strategy")) and clips_by_norm:
        return (
            f"{origin('trainer.strategy', config)} shards the model with FSDP, and "
            f"{origin('trainer.gradient_clip_val', config)} clips gradients by their norm: Lightning 2.6 cannot "
            "clip by norm under FSDP (each process holds only a shard of the gradients) and would stop at the first "
            "optimizer step. Clip by value (--trainer.gradient_clip_algorithm=value), drop the clipping "
            "(--trainer.gradient_clip_val=null), or train with DDP (leave out the FSDP config)."
        )
    if _init_args_with(trainer.get("callbacks"), "save_last", "link") and _init_args_with(
        trainer.get("plugins"), "background", True
    ):
        return (
            "a ModelCheckpoint with save_last: link makes last.ckpt a link to the newest checkpoint as soon as its "
            "save is asked for, and the AtomicCheckpointIO with background: true writes that checkpoint later: a kill "
            "in between leaves last.ckpt pointing at nothing, and the same command would start the run afresh. Set "
            "save_last: true (a copy), or background: false on the AtomicCheckpointIO entry of trainer.plugins."
        )
    return None


def runs_on_cpu(trainer: dict[str, Any]) -> bool:
    """Whether Lightning will run the Trainer settings ``trainer`` (a dict) on CPU: asked for, or no GPU to pick."""
    accelerator = trainer.get("accelerator", "auto")
    gpu = CUDAAccelerator.is_available() or MPSAccelerator.is_available()
    return accelerator == "cpu" or (accelerator == "auto" and not gpu)


def gpu_only_problem(config: dict[str, Any]) -> str | None:
    """The paragraph for a setting only a GPU runs, in ``config`` (a subcommand's, a dict) that runs on CPU: FSDP,
    which Lightning refuses advising accelerator='cuda' even where there is none, SyncBatchNorm, which fails in every
    process at its first batch, and float16 mixed precision, which Lightning replaces with bfloat16 on CPU with a
    one-line warning."""
    trainer = config.get("trainer") or {}
    where = "trainer.accelerator=cpu" if trainer.get("accelerator") == "cpu" else "this machine has no CUDA GPU"
    cpu_only = trainer.get("accelerator") == "cpu" or not CUDAAccelerator.is_available()
    if _is_fsdp(trainer.get("strategy")) and cpu_only:
        return (
            f"{origin('trainer.strategy', config)} shards the model with FSDP, which runs on CUDA GPUs only, and "
            f"{where}. On CPU, train with DDP, the strategy of configs/ddp.yaml (leave that setting out): it runs "
            "trainer.devices processes with gloo."
        )
    if trainer.get("sync_batchnorm") and cpu_only:
        return (
            f"{origin('trainer.sync_batchnorm', config)} converts batch norm layers to torch's SyncBatchNorm, which "
            f"runs on CUDA GPUs only, and {where}: every process would stop at its first batch. On CPU leave it out "
            "(--trainer.sync_batchnorm=false): each process then normalises by the statistics of its own batch."
        )
    if runs_on_cpu(trainer) and str(trainer.get("precision")) in ("16", "16-mixed"):
        return (
            f"{origin('trainer.precision', config)} asks for float16 mixed precision, which Lightning runs on CUDA "
            f"GPUs only, and {where}: Lightning would train in bfloat16 instead. For mixed precision on CPU, set "
            "trainer.precision=bf16-mixed (configs/bf16.yaml instead of configs/fp16.yaml); for full float32, "
            "leave trainer.precision out."
        )
    return None


def cores_warning(config: dict[str, Any]) -> str | None:
    """The line warning that ``config`` (a subcommand's, a dict) starts more CPU processes on a node than this
    process may use cores, or None. They train, taking turns on the cores: slower than one process per core."""
    trainer = config.get("trainer") or {}
    devices, cores = str(trainer.get("devices", "auto")), len(os.sched_getaffinity(0))
    if not runs_on_cpu(trainer) or not POSITIVE.fullmatch(devices) or int(devices) <= cores:
        return None
    return (
        f"trainer.devices={devices} starts {devices} training processes on this node, which gives them {cores} CPU "
        f"core{'s' if cores > 1 else ''}: they take turns on the cores, so each step is slower than with one process "
        f"per core. Set trainer.devices to at most {cores} for a core each."
    )


def entries(setting: Any) -> list[dict[str, Any]]:
    """The ``class_path`` entries of a setting that takes one or a list of them (trainer.logger, trainer.callbacks),
    as dicts; a value that is no entry (``false``, a name) is left out."""
    return [entry for entry in (setting if isinstance(setting, list) else [setting]) if isinstance(entry, dict)]


def _init_args_with(setting: Any, key: str, value: Any) -> bool:
    """Whether any ``class_path`` entry of ``setting`` (a list of them, or one) sets ``key`` to ``value``."""
    return any((entry.get("init_args") or {}).get(key) == value for entry in entries(setting))


# Trainer values Lightning takes without a check: (key, whether a value fits, what Lightning does with a wrong one,
# what the key takes).
RANGES = (
    (
        "accumulate_grad_batches",
        lambda value: isinstance(value, int) and value >= 1,
        "divides by it and would stop at the first batch with a ZeroDivisionError",
        "a positive number of batches per optimizer step (1: step after every batch)",
    ),
    (
        "check_val_every_n_epoch",
        lambda value: value is None or (isinstance(value, int) and value >= 1),
        "divides by it and would stop at the end of the first epoch with a ZeroDivisionError",
        "a positive number of epochs, or null to validate every val_check_interval batches",
    ),
    (
        "gradient_clip_val",
        lambda value: value is None or value >= 0,
        "clips nothing at a value below 0, without a word",
        "the gradient norm (or value) to clip at, such as 1.0, or null (or 0) for no clipping",
    ),
)


def trainer_problem(config: dict[str, Any]) -> str | None:
    """What is wrong with ``trainer.devices`` or a value in RANGES of ``config`` (a subcommand's, a dict), or None."""
    if problem := devices_problem(config):
        return problem
    trainer = config.get("trainer") or {}
    accelerator = trainer.get("accelerator", "auto")
    if accelerator in ("gpu", "cuda") and not (CUDAAccelerator.is_available() or MPSAccelerator.is_available()):
        build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU build, without CUDA"
        return (
            f"trainer.accelerator={accelerator}, but torch sees no GPU on this machine (torch {torch.__version__} is "
            f"{build}). Train on CPU with trainer.accelerator=cpu, or auto (every visible GPU, else the CPU); for "
            "GPUs, install a CUDA build of torch and the NVIDIA driver, and check CUDA_VISIBLE_DEVICES."
        )
    for key, fits, wrong, takes in RANGES:
        if key in trainer and not fits(trainer[key]):
            value = trainer[key]  # as given: where the Trainer takes a float (Lightning 2.6), -1 is read as -1.0
            shown = int(value) if isinstance(value, float) and value.is_integer() else value
            return f"trainer.{key}={shown}: Lightning {wrong}. trainer.{key} takes {takes}."
    strategy = trainer.get("strategy")
    waits = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    for key in ("timeout", "join_timeout", "peer_timeout"):  # training.DDPStrategy's
        if isinstance(waits.get(key), timedelta) and waits[key] <= timedelta(0):
            return (
                f"trainer.strategy.init_args.{key}={waits[key]}: a wait of no time would stop the job at its first "
                f'chance. Give a duration as "h:mm:ss", such as the "{DEFAULT_WAITS[key]}" of configs/ddp.yaml.'
            )
    return None


def devices_problem(config: dict[str, Any]) -> str | None:
    """What is wrong with ``trainer.devices`` in ``config`` (a subcommand's, as a dict), or None.

    Lightning parses the value with the accelerator's own rules when it builds the Trainer, and rejects most wrong
    ones (``abc``, ``-5``, ``-1`` without a GPU) in a TypeError or ValueError traceback, or says GPUs are missing.
    """
    trainer = config.get("trainer") or {}
    devices, accelerator = trainer.get("devices", "auto"), trainer.get("accelerator", "auto")
    text = ",".join(map(str, devices)) if isinstance(devices, list) else "".join(str(devices).split())
    if runs_on_cpu(trainer):  # the accelerator Lightning picks
        if not isinstance(devices, list) and (text == "auto" or POSITIVE.fullmatch(text)):
            return None
        where = "trainer.accelerator=cpu" if accelerator == "cpu" else "this machine has no GPU"
        return (
            f"trainer.devices={devices} is not a number of processes: on CPU ({where}) trainer.devices takes a "
            "positive number of processes per node, such as 2; -1 and GPU ids need GPUs."
        )
    if isinstance(devices, list) or "," in text:
        ids = text.rstrip(",").split(",")
        if GPU_IDS.fullmatch(text) and len(set(map(int, ids))) == len(ids):
            return None
    elif text in ("auto", "-1") or POSITIVE.fullmatch(text):
        return None
    return (
        f"trainer.devices={devices} names no devices: trainer.devices takes a number of devices per node (a positive "
        'integer), -1 or auto for every visible GPU, or the ids of the GPUs to use once each, such as [0, 1] or "0,1".'
    )


def _is_fsdp(strategy: Any) -> bool:
    if isinstance(strategy, str):
        return strategy.startswith("fsdp")
    module, _, name = str((strategy or {}).get("class_path")).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, FSDPStrategy)


def origin(key: str, config: dict[str, Any]) -> str:
    """Where the dotted ``key`` of ``config`` (a subcommand's, a dict) got its value: the last config file that sets it
    (later files override earlier ones), unless the command line set another value over it."""
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    for file in reversed([str(path) for path in config.get("config") or []]):
        node: Any = read_yaml(Path(file).read_text())
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return (
                f"{file} ({key})" if _class_or_value(node) == _class_or_value(value) else f"--{key} on the command line"
            )
    return f"--{key} on the command line"


def _class_or_value(setting: Any) -> str:
    """A setting as two sources compare: a class's path (the parser fills in its init_args), else its text."""
    return str(setting.get("class_path") if isinstance(setting, dict) else setting)
