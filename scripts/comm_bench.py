"""Collective bandwidth over a sweep of message sizes, with nccl-tests' definitions of bandwidth.

Run through the doctor on every node: ``BENCH=1 ./scripts/doctor.sh GPUS NODE_RANK``. For a message of
S bytes taking t seconds on n processes, as NVIDIA's nccl-tests define them:

- algorithm bandwidth ``algbw = S / t``;
- bus bandwidth, comparable between operations and process counts and with the hardware's link speed:
  all_reduce ``algbw * 2(n-1)/n``, all_gather ``algbw * (n-1)/n`` (S: the gathered output), broadcast ``algbw``.
"""

import csv
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

OPERATIONS = ("all_reduce", "all_gather", "broadcast")
FIELDS = ("operation", "bytes", "time_us", "algbw_GBps", "busbw_GBps", "processes")


def message_sizes(max_bytes: int, min_bytes: int = 1024) -> list[int]:
    """Powers of 4 from ``min_bytes`` up to ``max_bytes``."""
    sizes = [min_bytes]
    while sizes[-1] * 4 <= max_bytes:
        sizes.append(sizes[-1] * 4)
    return sizes


def bus_factor(operation: str, processes: int) -> float:
    return {
        "all_reduce": 2 * (processes - 1) / processes,
        "all_gather": (processes - 1) / processes,
        "broadcast": 1.0,
    }[operation]


def _time_operation(operation: str, nbytes: int, device: torch.device, iterations: int) -> float:
    """Seconds one call takes, averaged over ``iterations`` after two warm-up calls, the slowest rank's."""
    processes = dist.get_world_size()
    elements = nbytes // 4
    if operation == "all_gather":
        # nccl-tests size all_gather by its output: each process contributes S/n.
        chunk = torch.ones(elements // processes, device=device)
        # Into one tensor, as nccl-tests does: a list is gathered through a flat buffer and copied apart each call.
        output = torch.empty(processes * chunk.numel(), device=device)
        # torch 2.13 renamed all_gather_into_tensor to all_gather_single and warns on every call of the old
        # name; torch 2.11 has only the old one.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def call() -> None:
            gather(output, chunk)
    else:
        tensor = torch.ones(elements, device=device)

        def call() -> None:
            if operation == "all_reduce":
                dist.all_reduce(tensor)
            else:
                dist.broadcast(tensor, src=0)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        call()
    synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    synchronize()
    elapsed = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def run(max_bytes: int, device: torch.device) -> list[dict[str, float | int | str]]:
    """Every operation at every size; the same rows on every rank. A collective call on all ranks."""
    processes = dist.get_world_size()
    rows: list[dict[str, float | int | str]] = []
    for operation in OPERATIONS:
        for nbytes in message_sizes(max_bytes):
            nbytes -= nbytes % (4 * processes)  # whole float32 elements, split evenly for all_gather
            iterations = 20 if nbytes <= 1 << 20 else 5
            seconds = _time_operation(operation, nbytes, device, iterations)
            algbw = nbytes / seconds / 1e9
            rows.append(
                {
                    "operation": operation,
                    "bytes": nbytes,
                    "time_us": seconds * 1e6,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * bus_factor(operation, processes),
                    "processes": processes,
                }
            )
    return rows


def table(rows: list[dict[str, float | int | str]]) -> str:
    lines = [f"{'operation':<11} {'bytes':>11} {'time (us)':>11} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"]
    for row in rows:
        lines.append(
            f"{row['operation']:<11} {row['bytes']:>11} {row['time_us']:>11.1f} "
            f"{row['algbw_GBps']:>13.3f} {row['busbw_GBps']:>13.3f}"
        )
    return "\n".join(lines)


def write(rows: list[dict[str, float | int | str]], out_dir: Path, title: str) -> list[Path]:
    """Save the rows as CSV and JSON and plot bus bandwidth against message size as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "comm_bench.csv", out_dir / "comm_bench.json", out_dir / "comm_bench.png"]
    with open(paths[0], "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    paths[1].write_text(json.dumps({"title": title, "rows": rows}, indent=2))

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for operation in OPERATIONS:
        points = [row for row in rows if row["operation"] == operation]
        axes.plot([row["bytes"] for row in points], [row["busbw_GBps"] for row in points], marker="o", label=operation)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(paths[2], dpi=120)
    plt.close(figure)
    return paths
