"""The benchmark's comparisons: training steps (template, Lightning alone, raw loop, and the template without
training.StepTime or logging), the data path alone, and start-up; the medians and per-round ratios they report."""

import argparse
import itertools
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.sides import module_run, quiet_run, run, template_run, untimed_run
from benchmarks.workloads import REPO


def median_step(record: Path, warmup: int, clock: str = "starts") -> float:
    """The median time between consecutive step starts, after ``warmup`` steps; by the process's CPU time with
    ``clock="cpu_starts"``."""
    starts = json.loads(record.read_text())[clock][warmup:]
    return statistics.median(b - a for a, b in itertools.pairwise(starts))


def max_weight_difference(a: Path, b: Path) -> float:
    # On the CPU: the weights of a GPU run were saved from its GPU.
    first, second = (torch.load(path.with_suffix(".pt"), map_location="cpu") for path in (a, b))
    return max(float((first[k] - second[k]).abs().max()) for k in first)


def paired(numerator: list[float], denominator: list[float]) -> dict:
    """The median and range of the per-round ratios: each round's two runs ran back to back, so a slow spell
    of the machine that lasts longer than a round slows both."""
    ratios = [n / d for n, d in zip(numerator, denominator, strict=True)]
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}


def logged_row(args: argparse.Namespace) -> tuple[str, int]:
    """The row logging and start-up are measured on: the toy model's with the most processes."""
    return "toy", max(args.processes["toy"])


def row_sides(args: argparse.Namespace, workload: str, processes: int) -> dict:
    """The sides of one row, by name: how to run each once. Every row measures what the step-time measurement
    costs (the template without training.StepTime); the logged row, and every row of the short and quick modes, the
    template without logger and progress bar too, which is what plain Lightning runs without (quick mode checks
    that every side runs on every workload)."""
    sides = {
        "template": template_run,
        "lightning": partial(module_run, "benchmarks.lightning_only"),
        "raw": partial(module_run, "benchmarks.raw_ddp"),
        "untimed": untimed_run,
    }
    if args.short or args.quick or (workload, processes) == logged_row(args):
        sides["quiet"] = quiet_run
    return sides


def compare_steps(args: argparse.Namespace, work: Path) -> tuple[list[dict], dict, list[float]]:
    """One row per workload and process count; what logging costs; and the seconds from launch to the first
    step of the template runs of the logged row."""
    rows, logging, first_steps = [], {}, []
    for workload in args.processes:
        steps = args.warmup + args.steps[workload] + 1
        for processes in args.processes[workload]:
            sides = row_sides(args, workload, processes)
            medians: dict[str, list[float]] = {side: [] for side in sides}
            run_s: dict[str, list[float]] = {side: [] for side in sides}
            difference = 0.0
            for round_ in range(args.rounds):
                # The sides take turns to go first, so a slow spell at the start of a round hits each in turn.
                turn = round_ % len(sides)
                order = list(sides)[turn:] + list(sides)[:turn]
                records = {}
                for side in order:
                    name = f"{side}-{workload}-{processes}-{round_}"
                    launched = time.monotonic()
                    records[side] = sides[side](
                        workload, processes, steps, args.quick, args.accelerator, work, name, bound=args.side_timeout
                    )
                    run_s[side].append(time.monotonic() - launched)
                    medians[side].append(median_step(records[side], args.warmup))
                for side in ("template", "lightning"):
                    difference = max(difference, max_weight_difference(records[side], records["raw"]))
                if (workload, processes) == logged_row(args):
                    timing = json.loads(records["template"].read_text())
                    first_steps.append(timing["first_step_wall"] - timing["launched"])
                print(f"  {workload}, {processes} process(es): round {round_ + 1}/{args.rounds} done", flush=True)
            rows.append(
                {
                    "workload": workload,
                    "processes": processes,
                    **{f"{side}_step_ms": 1e3 * statistics.median(medians[side]) for side in sides},
                    "rounds_step_ms": {side: [1e3 * m for m in medians[side]] for side in sides},
                    "run_s": {side: statistics.median(seconds) for side, seconds in run_s.items()},
                    "ratio": paired(medians["template"], medians["raw"]),
                    "lightning_over_raw": paired(medians["lightning"], medians["raw"]),
                    "template_over_lightning": paired(medians["template"], medians["lightning"]),
                    **(
                        {"quiet_over_lightning": paired(medians["quiet"], medians["lightning"])}
                        if "quiet" in sides
                        else {}
                    ),
                    "max_weight_difference": difference,
                    "step_time_cost": {k: v - 1 for k, v in paired(medians["template"], medians["untimed"]).items()},
                }
            )
            if (workload, processes) == logged_row(args):
                cost = paired(medians["template"], medians["quiet"])
                logging = {
                    "processes": processes,
                    "default_step_ms": 1e3 * statistics.median(medians["template"]),
                    "quiet_step_ms": 1e3 * statistics.median(medians["quiet"]),
                    "cost": {key: value - 1 for key, value in cost.items()},
                }
            raw, lightning = rows[-1]["ratio"]["median"], rows[-1]["template_over_lightning"]["median"]
            print(f"  {workload}, {processes} process(es): {raw:.3f}x raw, {lightning:.3f}x Lightning", flush=True)
    return rows, logging, first_steps


def compare_data_path(args: argparse.Namespace) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    from data import RandomDataModule
    from data.random_data import batch_loader

    torch.set_num_threads(1)
    data = RandomDataModule(num_train=2048 if args.quick else 65536, batch_size=128)
    data.setup("fit")
    split = data.splits["train"]
    loaders = {
        "per_sample": DataLoader(TensorDataset(*split.tensors), batch_size=128, shuffle=True),
        "whole_batch": batch_loader(split, 128, shuffle=True, pin_memory=False),
    }
    timings: dict[str, list[float]] = {name: [] for name in loaders}
    for round_ in range(args.rounds + 1):
        for name, loader in loaders.items():
            start = time.perf_counter()
            batches = sum(1 for _ in loader)
            if round_:  # the first round warms up
                timings[name].append((time.perf_counter() - start) / batches)
    per_sample, whole_batch = (statistics.median(timings[name]) for name in loaders)
    return {"per_sample_us": 1e6 * per_sample, "whole_batch_us": 1e6 * whole_batch, "speedup": per_sample / whole_batch}


def compare_startup(args: argparse.Namespace, work: Path, first_steps: list[float]) -> dict:
    commands = {
        "cli_help": [sys.executable, str(REPO / "cli.py"), "--help"],
        "import_lightning": [sys.executable, "-c", "import lightning"],
    }
    timings: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.rounds):
        for name, command in commands.items():
            start = time.perf_counter()
            run(command, cwd=work / name, bound=args.side_timeout)
            timings[name].append(time.perf_counter() - start)
    help_s, import_s = (statistics.median(timings[name]) for name in commands)
    return {
        "cli_help_s": help_s,
        "import_lightning_s": import_s,
        "ratio": help_s / import_s,
        "first_step_s": statistics.median(first_steps),
    }
