"""What keeps a run from its GPUs, found before anything starts: NVIDIA GPUs that this torch cannot use (a run with
accelerator auto would train on the CPU after one warning), and bfloat16 on GPUs without bfloat16 units (Lightning and
torch accept it there and emulate it, slower than float32, without a word)."""

import os
import re
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator

from training.config.trainer_settings import origin

NATIVE_BF16 = 8  # the first compute capability (major) with bfloat16 tensor cores: Ampere
DRIVER = Path("/proc/driver/nvidia/version")  # there while the NVIDIA driver's kernel module is loaded
# The oldest driver that runs each CUDA major version (NVIDIA's release notes; 12: with minor version compatibility).
OLDEST_DRIVER = {13: 580, 12: 525, 11: 450}


def driver_version() -> str | None:
    """The loaded NVIDIA driver's version, from its kernel module's banner; None where none is loaded."""
    if not DRIVER.is_file():
        return None
    found = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", DRIVER.read_text().partition("\n")[0])
    return found.group(1) if found else "unknown"


def unusable_gpus_problem(config: dict[str, Any]) -> str | None:
    """The paragraph for a run that asks for the GPUs (accelerator auto, gpu or cuda) on a node whose NVIDIA driver is
    loaded but whose torch cannot use the GPUs, or None. GPUs hidden on purpose (CUDA_VISIBLE_DEVICES empty) are none
    of its business."""
    accelerator = str((config.get("trainer") or {}).get("accelerator", "auto"))
    if accelerator not in ("auto", "gpu", "cuda") or os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return None
    driver = driver_version()
    if driver is None or torch.version.hip or CUDAAccelerator.is_available():
        return None
    build = torch.version.cuda
    if build is None:
        why = "it is a CPU build, without CUDA"
        fix = f"install a CUDA build of torch {torch.__version__.split('+')[0]}"
    else:
        oldest = OLDEST_DRIVER.get(int(build.split(".")[0]))
        too_old = oldest is not None and driver != "unknown" and int(driver.split(".")[0]) < oldest
        why = f"it is built for CUDA {build}" + (f", which needs driver {oldest} or newer" if too_old else "")
        fix = "install a torch built for a CUDA version this driver runs (or update the driver)"
    return (
        f"this node has NVIDIA GPUs (driver {driver} is loaded), but torch {torch.__version__} cannot use them: {why}. "
        f"With trainer.accelerator={accelerator} the run would train on the CPU instead. To train on the GPUs, {fix}: "
        "docs/versions.md shows how to pick the build for a driver (nvidia-smi shows the driver and the newest CUDA "
        "version it runs). To train on the CPU on purpose, set trainer.accelerator=cpu (the launcher's cpu:N). "
        "Nothing was started."
    )


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
