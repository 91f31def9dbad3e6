"""One side of benchmarks/gpu_defaults.py: the seq2seq example under a plain Lightning ``Trainer``, as configured.

    python -m benchmarks.gpu_defaults_side --out side.json [--quick] [--accelerator gpu] [--steps N] [--data-dir D]
        [-- --trainer.precision=32-true ...]

The model and data module come from configs/ddp.yaml, configs/seq2seq.yaml and configs/seq2seq_gpu.yaml through the
CLI's own parser (its checks included), with the overrides after ``--``, as benchmarks/lightning_only.py builds
them; one process trains them under a plain Trainer with the config's ``trainer.precision`` and nothing of the
template, then validates once. The record (benchmarks/timing.py: step start times, weights beside it) gets the
exact match reached and the settings the run had in effect, read from the trainer, optimizer and loader.
"""

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from lightning.pytorch import Trainer

from benchmarks.timing import StepTimer
from benchmarks.workloads import ACCELERATORS, WORKLOADS, build, device_problem

# The benchmark's seq2seq workload (benchmarks/bench.py's sizes) with the GPU settings after its configs.
WORKLOAD = dataclasses.replace(
    WORKLOADS["seq2seq"], configs=(*WORKLOADS["seq2seq"].configs, "configs/seq2seq_gpu.yaml")
)
METRIC = "val/exact_match"


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
    return Trainer(
        accelerator=accelerator,
        devices=1,
        precision=precision,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        **kwargs,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON record; the weights go beside it")
    parser.add_argument("--quick", action="store_true", help="the small sizes of benchmarks/bench.py --quick")
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="cpu")
    parser.add_argument("--steps", type=int, required=True, help="training steps, each timed from its start")
    parser.add_argument("--data-dir", default="cache", help="where the corpus is (generated if missing)")
    parser.add_argument("overrides", nargs="*", help="after --: cli.py flags over the configs")
    args = parser.parse_args()
    if problem := device_problem(args.accelerator, 1):
        parser.error(problem)
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
        callbacks=[StepTimer(args.out)],
    )
    trainer.fit(built.model, datamodule=built.datamodule)
    settings = settings_in_effect(trainer)
    # A Trainer of its own: the training one validates nothing (limit_val_batches=0, so no step waits for it).
    (metrics,) = plain_trainer(args.accelerator, precision).validate(
        built.model, datamodule=built.datamodule, verbose=False
    )
    record = Path(args.out)
    extra = {"exact_match": metrics[METRIC], "settings": settings}
    record.write_text(json.dumps({**json.loads(record.read_text()), **extra}))


if __name__ == "__main__":
    main()
