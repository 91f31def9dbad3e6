"""One side of benchmarks/gpu_defaults.py: the seq2seq example under a plain Lightning ``Trainer``, as configured.

    python -m benchmarks.gpu_defaults_side --out side.json [--quick] [--accelerator gpu] [--steps N] [--data-dir D]
        [--warmup N] [-- --trainer.precision=32-true ...]

The model and data module come from configs/ddp.yaml, configs/seq2seq.yaml and configs/seq2seq_gpu.yaml through the
CLI's own parser (its checks included), with the overrides after ``--``, as benchmarks/lightning_only.py builds
them; one process trains them under a plain Trainer with the config's ``trainer.precision`` and nothing of the
template, then validates once. Its record (JSON) holds the seconds its steps after warm-up took, the exact match
it reached and the settings it had in effect, read from the trainer, optimizer and loader.
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from benchmarks.lightning_only import BARE
from benchmarks.workloads import ACCELERATORS, WORKLOADS, build, device_problem

# The benchmark's seq2seq workload (benchmarks/bench.py's sizes) with the GPU settings after its configs.
WORKLOAD = dataclasses.replace(
    WORKLOADS["seq2seq"], configs=(*WORKLOADS["seq2seq"].configs, "configs/seq2seq_gpu.yaml")
)
METRIC = "val/exact_match"


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished the work queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class SpanTimer(Callback):
    """The time from the start of the first step after ``warmup`` to the end of training, read once the GPU has
    finished: between the two the process runs ahead of the GPU as training does, so a copy that overlaps the GPU's
    work (pinned memory) or a batch made while it computes (workers) shortens the span. Two reads, each waiting for
    the GPU, are all a span needs."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.batches = 0
        self.start = self.end = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.batches += 1
        if self.batches == self.warmup + 1:
            self.start = clock(pl_module.device)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.end = clock(pl_module.device)


def settings_in_effect(trainer: Trainer) -> dict:
    """What the run did for each choice, read from the objects that do it, not from the config."""
    optimizer = trainer.optimizers[0]
    loader = trainer.train_dataloader
    return {
        "precision": str(trainer.precision),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "fused": bool(optimizer.defaults.get("fused")),
        "num_workers": loader.num_workers,
        "persistent_workers": loader.persistent_workers,
        "pin_memory": loader.pin_memory,
    }


def plain_trainer(accelerator: str, precision: str, **kwargs) -> Trainer:
    """A Trainer with nothing of the template: no logger, progress bar, checkpointing or model summary."""
    return Trainer(accelerator=accelerator, devices=1, precision=precision, **BARE, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON record it writes")
    parser.add_argument("--quick", action="store_true", help="the small sizes of benchmarks/bench.py --quick")
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="cpu")
    parser.add_argument("--steps", type=int, required=True, help="training steps")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the time (default 1)")
    parser.add_argument("--data-dir", default="cache", help="where the corpus is (generated if missing)")
    parser.add_argument("overrides", nargs="*", help="after --: cli.py flags over the configs")
    args = parser.parse_args()
    if problem := device_problem(args.accelerator, 1):
        parser.error(problem)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be at least 0 and below --steps, got {args.warmup}")
    arguments = WORKLOAD.arguments(args.quick, Path(args.data_dir), args.accelerator)
    # seed_everything from the config, then the classes: every side starts from the same weights.
    built = build([*arguments, *args.overrides, "--trainer.devices=1"])
    precision = built.trainer.precision  # as the template would run it: the config's, through its checks
    trainer = plain_trainer(
        args.accelerator,
        precision,
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[timer := SpanTimer(args.warmup)],
    )
    trainer.fit(built.model, datamodule=built.datamodule)
    settings = settings_in_effect(trainer)
    # A Trainer of its own: the training one validates nothing (limit_val_batches=0, so no step waits for it).
    (metrics,) = plain_trainer(args.accelerator, precision).validate(
        built.model, datamodule=built.datamodule, verbose=False
    )
    record = {
        "timed_steps": timer.batches - args.warmup,
        "seconds": timer.end - timer.start,
        "exact_match": metrics[METRIC],
        "settings": settings,
    }
    Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
