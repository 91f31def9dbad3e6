"""Time the toy data path: a per-sample collate versus whole-batch indexing, beside a training step.

    python benchmarks/data_path.py [--batch-size 64] [--repeats 7]

Runs the two loaders alternately (A/B/A/B) over the toy model's training split and prints the median
time per batch of each, their ratio, and the time of one forward/backward/step of the toy model for scale.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from data import RandomDataModule  # noqa: E402
from data.random_data import batch_loader  # noqa: E402
from models import ToyModel  # noqa: E402


def seconds_per_batch(loader: DataLoader) -> float:
    start = time.perf_counter()
    batches = sum(1 for _ in loader)
    return (time.perf_counter() - start) / batches


def step_seconds(batch_size: int, steps: int = 200) -> float:
    model = ToyModel()
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(batch_size, 32), torch.randn(batch_size, 8)
    start = time.perf_counter()
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    torch.set_num_threads(1)
    data = RandomDataModule(batch_size=args.batch_size)
    data.setup("fit")
    split = data.splits["train"]
    loaders = {
        "per-sample collate": DataLoader(TensorDataset(*split.tensors), batch_size=args.batch_size, shuffle=True),
        "whole-batch index": batch_loader(split, args.batch_size, shuffle=True, pin_memory=False),
    }
    timings: dict[str, list[float]] = {name: [] for name in loaders}
    for loader in loaders.values():  # warm-up
        seconds_per_batch(loader)
    for _ in range(args.repeats):
        for name, loader in loaders.items():
            timings[name].append(seconds_per_batch(loader))

    medians = {name: statistics.median(values) for name, values in timings.items()}
    step = step_seconds(args.batch_size)
    print(f"batch size {args.batch_size}, {len(split)} samples, 1 thread, median of {args.repeats} epochs")
    for name, value in medians.items():
        print(f"{name:>20}: {value * 1e6:8.1f} us/batch ({value / step:5.2f}x a toy-model training step)")
    print(f"{'toy-model step':>20}: {step * 1e6:8.1f} us/batch")
    print(f"per-sample / whole-batch: {medians['per-sample collate'] / medians['whole-batch index']:.1f}x")


if __name__ == "__main__":
    main()
