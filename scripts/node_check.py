"""The doctor's checks of this machine alone: versions, the GPUs against the GPU list, /dev/shm.

Each line the doctor prints starts with its status (``ok``, ``note``, ``WARN``, ``FAIL``) in a column of its own.
"""

import argparse
import os
import platform

import lightning
import torch

from scripts import gpu_check
from training.config.gpu_support import driver_version
from training.job import versions

MIN_SHM_BYTES = 512 << 20


def say(status: str, text: str) -> None:
    print(f"{status:<5} {text}", flush=True)


def check_node(args: argparse.Namespace) -> bool:
    """The checks of this machine alone; False when training could not run here."""
    say("ok", f"python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}")
    for note in versions.newer_than_tested() + versions.known_bugs():
        say("note", note.removeprefix("note: "))
    healthy = True
    if args.accelerator == "gpu":
        if why := gpu_check.problem(args.nproc):
            say("FAIL", why)
            return False
        visible = torch.cuda.device_count()
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(visible))
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        build = f"NVIDIA driver {driver_version() or 'unknown'}, CUDA {torch.version.cuda}, NCCL {nccl}"
        say("ok", f"{build}; {visible} visible GPU(s): {names}")
    else:
        say("ok", f"{args.nproc} CPU process(es) on gloo")
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    if shm is None or shm.f_blocks * shm.f_frsize < MIN_SHM_BYTES:
        size = f"{shm.f_blocks * shm.f_frsize >> 20} MiB" if shm else "missing"
        say(
            "FAIL",
            f"/dev/shm is {size}: DataLoader workers pass batches through it and fail with a bus error. "
            "In Docker run with --ipc host or --shm-size 16g.",
        )
        healthy = False
    else:
        say("ok", f"/dev/shm has {shm.f_blocks * shm.f_frsize >> 20} MiB")
    return healthy
