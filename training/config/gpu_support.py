"""Settings the run's GPUs cannot run at speed, found before anything starts: bfloat16 on GPUs without bfloat16
units. Lightning and torch accept it there and emulate it, slower than float32, without a word."""

from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator

from training.config.trainer_settings import origin

NATIVE_BF16 = 8  # the first compute capability (major) with bfloat16 tensor cores: Ampere


def used_gpus(devices: Any) -> list[int]:
    """The ids of the GPUs that ``trainer.devices`` (as Lightning reads it: a count, -1 or auto for all, or ids
    such as [0, 1] or "0,1") takes on this node, among the visible ones (Lightning names an id beyond them)."""
    visible = torch.cuda.device_count()
    text = "".join(str(devices).split())
    if isinstance(devices, list) or "," in text:
        ids = devices if isinstance(devices, list) else text.rstrip(",").split(",")
        return sorted({int(i) for i in ids if int(i) < visible})
    if text in ("auto", "-1"):
        return list(range(visible))
    return list(range(min(int(text), visible)))


def bf16_problem(config: dict[str, Any]) -> str | None:
    """The paragraph for bfloat16 precision in ``config`` (a subcommand's, as a dict) on a GPU of this node without
    bfloat16 units, or None. ROCm GPUs and CPUs run it."""
    trainer = config.get("trainer") or {}
    if not str(trainer.get("precision")).startswith("bf16") or torch.version.hip:
        return None
    if trainer.get("accelerator", "auto") not in ("auto", "gpu", "cuda") or not CUDAAccelerator.is_available():
        return None
    for gpu in used_gpus(trainer.get("devices", "auto")):
        major, minor = torch.cuda.get_device_capability(gpu)
        if major < NATIVE_BF16:
            return (
                f"{origin('trainer.precision', config)} asks for bfloat16, and GPU {gpu} of this node "
                f"({torch.cuda.get_device_name(gpu)}, compute capability {major}.{minor}) has no bfloat16 units "
                f"(compute capability {NATIVE_BF16}.0 and newer: A100, A10, L4, H100, RTX 30xx and later): torch "
                "would emulate bfloat16, slower than float32. On this GPU set trainer.precision=16-mixed (float16 "
                "with loss scaling: -c configs/fp16.yaml as the last config file), or trainer.precision=32-true for "
                "float32."
            )
    return None
