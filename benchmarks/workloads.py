"""What the benchmark trains: each workload's configs and overrides, the same for every side of a comparison."""

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import cli

REPO = Path(__file__).resolve().parents[1]
SEED = 42  # seed_everything in configs/ddp.yaml; Lightning seeds its DistributedSampler with it too


@dataclass(frozen=True)
class Workload:
    configs: tuple[str, ...]
    overrides: tuple[str, ...]
    quick_overrides: tuple[str, ...]

    def arguments(self, quick: bool, data_dir: Path, accelerator: str) -> list[str]:
        """Config files and overrides as ``cli.py`` takes them, without the subcommand."""
        configs = [arg for config in self.configs for arg in ("-c", str(REPO / config))]
        overrides = self.quick_overrides if quick else self.overrides
        return [*configs, *(o.format(data_dir=data_dir) for o in overrides), f"--trainer.accelerator={accelerator}"]


NULL_SIZES = (
    "--data.init_args.num_features=2",
    "--data.init_args.num_targets=1",
    "--model.init_args.hidden_features=2",
    "--data.init_args.batch_size=2",
    "--data.init_args.num_train=100000",
)
WORKLOADS = {
    # An MLP of 1.3M parameters, batch 128: a step short enough that any per-step overhead shows.
    "toy": Workload(
        configs=("configs/ddp.yaml",),
        overrides=(
            "--data.init_args.num_features=512",
            "--data.init_args.num_targets=128",
            "--model.init_args.hidden_features=2048",
            "--data.init_args.batch_size=128",
            "--data.init_args.num_train=65536",
        ),
        quick_overrides=("--data.init_args.num_train=2048", "--data.init_args.batch_size=32"),
    ),
    "seq2seq": Workload(
        configs=("configs/ddp.yaml", "configs/seq2seq.yaml"),
        overrides=("--data.init_args.data_dir={data_dir}",),
        # Numbers of up to 3 digits (short sequences) and one layer each side: a step in milliseconds.
        quick_overrides=(
            "--data.init_args.data_dir={data_dir}",
            "--data.init_args.num_pairs=400",
            "--data.init_args.max_digits=3",
            "--data.init_args.batch_size=16",
            "--model.init_args.d_model=32",
            "--model.init_args.dim_feedforward=64",
            "--model.init_args.num_encoder_layers=1",
            "--model.init_args.num_decoder_layers=1",
        ),
    ),
    # Almost no compute: a step is the Python around it (benchmarks/overhead.py).
    "null": Workload(configs=("configs/ddp.yaml",), overrides=NULL_SIZES, quick_overrides=NULL_SIZES),
}
# The workloads of benchmarks/bench.py's step-time rows.
STEP_WORKLOADS = ("toy", "seq2seq")


ACCELERATORS = ("cpu", "gpu")


def device_problem(accelerator: str, processes: int) -> str:
    """Why ``processes`` processes cannot train on ``accelerator`` here, one GPU each; empty when they can."""
    if accelerator == "cpu":
        return ""
    found = torch.cuda.device_count()
    if found == 0:
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        return (
            f"--accelerator gpu needs a CUDA GPU, and torch {torch.__version__} ({build}) finds none "
            f"(CUDA_VISIBLE_DEVICES: {visible}); run it on a GPU machine, or leave --accelerator at cpu"
        )
    if processes > found:
        return (
            f"--processes {processes} with --accelerator gpu needs {processes} GPUs, one per process, and this "
            f"machine has {found}; give at most --processes {found}"
        )
    return ""


def run_arguments(description: str, logged: bool = False) -> argparse.Namespace:
    """The command line of benchmarks/raw_ddp.py and benchmarks/lightning_only.py, which bench.py runs alike;
    ``logged`` adds lightning_only's --logged."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--quick", action="store_true", help="the small sizes of benchmarks/bench.py --quick")
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="cpu", help="gpu: one GPU per process")
    parser.add_argument("--steps", type=int, required=True, help="training steps, each timed from its start")
    parser.add_argument("--out", required=True, help="JSON file of step start times; the weights go beside it")
    parser.add_argument("--data-dir", default="cache", help="where the seq2seq corpus is (generated if missing)")
    if logged:
        parser.add_argument("--logged", action="store_true", help="with the template's logger and progress bar")
    args = parser.parse_args()
    if problem := device_problem(args.accelerator, args.processes):
        parser.error(problem)
    return args


class BuildOnly(cli.CLI):
    """``python cli.py fit`` up to where it would train: the model and data module a template run trains, from
    the same configs and seed, for a side that trains them its own way."""

    def fit(self, model: Any, **kwargs: Any) -> None:
        """Train nothing: the side trains ``self.model`` and ``self.datamodule`` itself."""


def build(arguments: list[str]) -> BuildOnly:
    """The model and data module of ``python cli.py fit ARGUMENTS``, seeded by its ``seed_everything``."""
    return cli.main(["fit", *arguments], cli=BuildOnly)
