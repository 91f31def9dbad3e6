"""The doctor's check of CPU threads: the cores each process may use (its affinity) against the threads torch runs.

torch starts a thread per core it finds unless OMP_NUM_THREADS says otherwise, and every process of a node
finds the same cores unless a scheduler bound it to its own (srun with --cpus-per-task). More threads than
cores leaves threads waiting for each other in every operation: training slows down, on a busy machine a lot.
"""

import os

import torch


def threads_like_training(processes: int) -> None:
    """Run as many threads as a training process on this node would: OMP_NUM_THREADS, else (as Lightning's
    launcher, and scripts/run_ddp_train.sh for torchrun, do) this process's cores shared among the node's
    ``processes``."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // processes))


def usage() -> dict[str, list[int] | int]:
    """This process's usable cores and torch's thread count."""
    return {"cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


def ranges(cores: list[int]) -> str:
    """Core ids as Linux lists them: ``0-3,8``."""
    spans: list[list[int]] = []
    for core in sorted(cores):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def warnings(node: str, processes: list[dict]) -> list[str]:
    """What is wrong with the threads of one node's ``processes`` (each ``usage()`` plus its ``rank``)."""
    found = [
        f"rank {p['rank']} on {node} runs {p['threads']} threads on {len(p['cores'])} usable core(s) "
        f"({ranges(p['cores'])}): set OMP_NUM_THREADS to at most {len(p['cores'])}, or give the process more "
        "cores (under SLURM, --cpus-per-task, which srun must be given too)"
        for p in processes
        if p["threads"] > len(p["cores"])
    ]
    shared = sorted({core for p in processes for core in p["cores"]})
    total = sum(p["threads"] for p in processes)
    if not found and total > len(shared):
        found.append(
            f"the {len(processes)} processes on {node} run {total} threads in all on the {len(shared)} core(s) "
            f"they may use ({ranges(shared)}): set OMP_NUM_THREADS to at most "
            f"{max(1, len(shared) // len(processes))}, or unset it (each process then takes its share)"
        )
    return found
