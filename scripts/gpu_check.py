"""Whether torch on this node sees every GPU the GPU list names: checked before anything is launched.

CUDA_VISIBLE_DEVICES=0,1 python -m scripts.gpu_check 2   # exit 0, or 2 with the problem and its fix
"""

import os
import sys
from pathlib import Path

import torch

DRIVER = Path("/proc/driver/nvidia/version")


def problem(wanted: int) -> str | None:
    """Why torch cannot use ``wanted`` GPUs under this CUDA_VISIBLE_DEVICES, or None when it can."""
    seen = torch.cuda.device_count()
    if seen >= wanted:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    named = f"the GPU list names {wanted} GPU(s) (CUDA_VISIBLE_DEVICES={visible}), but torch sees {seen}"
    if seen == 1 and any(entry.startswith("MIG-") for entry in visible.split(",")):
        return (
            f"{named}: CUDA shows a process only the first MIG device of its list, and every process of a node "
            "gets the whole list. Give each node one MIG device (GPUS=MIG-...), or whole GPUs. Nothing was launched."
        )
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA: a CPU build"
    driver = (
        DRIVER.read_text().splitlines()[0].strip() if DRIVER.is_file() else f"no NVIDIA driver loaded (no {DRIVER})"
    )
    return (
        f"{named} on this node: torch {torch.__version__} has {build}; {driver}. Train on CPU with cpu:N, "
        "install a CUDA build of torch and the NVIDIA driver, or list GPUs this node has, by id or UUID "
        "(nvidia-smi -L). Nothing was launched."
    )


if __name__ == "__main__":
    if why := problem(int(sys.argv[1])):
        print(f"error: {why}", file=sys.stderr)
        sys.exit(2)
