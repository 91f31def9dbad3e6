"""Lightning's Trainer without the template: what Lightning's loop costs by itself.

    python -m benchmarks.lightning_only --workload toy --processes 2 --steps 60 --out lightning.json [--quick]
        [--accelerator gpu] [--logged]

The model and the data module come from the workload's configs through the CLI's own parser, as in
benchmarks/raw_ddp.py; they train under a plain ``lightning.pytorch.Trainer`` with Lightning's own
DDPStrategy (the same DDP settings as configs/ddp.yaml) and nothing else: no logger, progress bar,
checkpointing, model summary or template callback. It runs CPU processes, or one GPU per process with
``--accelerator gpu``. Against a template run it measures what the template adds; against the raw loop, what
Lightning's loop adds. With ``--logged`` it is the Trainer of Lightning's defaults (checkpointing, model summary,
progress bar) with the template's logger, log interval and progress bar refresh: what the template adds to a plain
Lightning run that logs the same. Rank 0 writes its step times and weights with benchmarks/timing.py, as a template run
does.
"""

from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy

from benchmarks.timing import StepTimer
from benchmarks.workloads import WORKLOADS, build, run_arguments

# A Trainer with nothing of the template: no logger, progress bar, checkpointing or model summary.
BARE = {"logger": False, "enable_progress_bar": False, "enable_checkpointing": False, "enable_model_summary": False}


def main() -> None:
    args = run_arguments(__doc__, logged=True)
    arguments = WORKLOADS[args.workload].arguments(args.quick, Path(args.data_dir), args.accelerator)
    # seed_everything from the config, then the classes: the same initial weights as a template run.
    built = build([*arguments, f"--trainer.devices={args.processes}"])
    settings = logged_like(built.trainer) if args.logged else BARE
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.processes,
        strategy=DDPStrategy(find_unused_parameters=False, gradient_as_bucket_view=True),
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **{**settings, "callbacks": [*settings.get("callbacks", []), StepTimer(args.out)]},
    )
    trainer.fit(built.model, datamodule=built.datamodule)


def logged_like(template: Trainer) -> dict:
    """The template's logger, log interval and progress bar as its configs give them, read from the trainer the
    template built: Lightning's settings for a run that logs the same."""
    return {
        "logger": TensorBoardLogger("logs", name="lightning", default_hp_metric=False),
        "log_every_n_steps": template.log_every_n_steps,
        "callbacks": [TQDMProgressBar(refresh_rate=template.progress_bar_callback.refresh_rate)],
    }


if __name__ == "__main__":
    main()
