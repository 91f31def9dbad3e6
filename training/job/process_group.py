"""How a training process lets go of its process group as it ends."""

import gc
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def leave_process_group(wrapper: Callable[[], Any]) -> None:
    """At exit, destroy the process group (torch warns of an NCCL one left), unless the DDP ``wrapper`` still lives.

    The wrapper must go first: its Reducer is freed with the GIL held, and were it the group's last holder, the
    group's destructor would join gloo's worker threads, which may need the GIL to free a finished all-reduce, and
    the process would never end. A wrapper something still holds (the traceback of an error in its forward) is
    freed as Python ends, before the group, which the process group registry holds until then.
    """
    if wrapper() is not None:
        gc.collect()
    if dist.is_initialized() and wrapper() is None:
        dist.destroy_process_group()
