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
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA: a CPU build"
    driver = (
        DRIVER.read_text().splitlines()[0].strip() if DRIVER.is_file() else f"no NVIDIA driver loaded (no {DRIVER})"
    )
    return (
        f"the GPU list names {wanted} GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}), "
        f"but torch sees {seen} on this node: torch {torch.__version__} has {build}; {driver}. Train on CPU "
        "with cpu:N, install a CUDA build of torch and the NVIDIA driver, or list GPU ids this node has "
        "(nvidia-smi -L). Nothing was launched."
    )


if __name__ == "__main__":
    if why := problem(int(sys.argv[1])):
        print(f"error: {why}", file=sys.stderr)
        sys.exit(2)
