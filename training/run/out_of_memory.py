"""A batch or a step that does not fit in memory: what did not fit, where, and the settings that make it fit."""

import re

import torch

# torch's CPU allocator refusing an allocation; MemoryError is Python's own.
CPU_REFUSAL = re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes")
GPU_REFUSAL = re.compile(r"Tried to allocate ([\d.]+ [KMGT]iB)")
STAGES = {
    "train": "a training step",
    "sanity_check": "the validation before training",
    "validate": "a validation step",
    "test": "a test step",
    "predict": "a prediction step",
}


def memory_refusal(error: BaseException) -> tuple[str, str] | None:
    """``(the memory, the size asked for)`` when ``error`` is an allocation that did not fit, else None."""
    if isinstance(error, torch.OutOfMemoryError):
        found = GPU_REFUSAL.search(str(error))
        return "GPU memory", found[1] if found else "more than was free"
    if isinstance(error, MemoryError):
        return "memory", "more than was free"
    found = CPU_REFUSAL.search(str(error)) if isinstance(error, RuntimeError) else None
    return ("memory", f"{int(found[1]) / 2**30:,.1f} GiB") if found else None


def out_of_memory(error: BaseException, who: str = "this process", stage: str | None = None) -> str | None:
    """The paragraph for ``error`` when it is an allocation that did not fit (None otherwise): ``who`` ran out of
    memory in ``stage`` (Lightning's stage name, or None where unknown)."""
    refusal = memory_refusal(error)
    if refusal is None:
        return None
    memory, size = refusal
    where = f" in {STAGES.get(stage, stage)}" if stage else ""
    shared = (
        "FSDP (configs/fsdp.yaml) shards the model's weights and optimizer state across the GPUs"
        if memory == "GPU memory"
        else "the processes of a machine share its memory: fewer of them (--trainer.devices) leave each more"
    )
    return (
        f"{who} ran out of {memory}{where}: it asked for {size}, which did not fit. Lower the batch size (the data "
        "module's batch_size, e.g. --data.init_args.batch_size) or the size of a sample (a sequence length, an image "
        f"size), or train in a lower precision (--trainer.precision=bf16-mixed); {shared}. Then run the same command: "
        "it resumes from the run's last.ckpt, if it has one."
    )
