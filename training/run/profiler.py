"""The template's profilers: none at all at no cost a step (the default of configs/ddp.yaml), and Lightning's
PyTorchProfiler with torch.profiler's schedule and recording options as arguments a YAML file can set."""

from contextlib import AbstractContextManager, nullcontext

import torch
from lightning.pytorch.profilers import PassThroughProfiler, PyTorchProfiler

from training.private_api import skip_hooks_not_overridden

NOTHING = nullcontext()


class NoProfiler(PassThroughProfiler):
    """Profiles nothing, as Lightning's default (``PassThroughProfiler``) does, at next to no cost.

    Lightning enters ``trainer.profiler.profile(name)`` around every hook it calls, about 110 times a training step of
    the template, most of them callback hooks that no callback defines; the base class's context manager is a
    generator, a microsecond of Python each time, for nothing recorded. This one hands back one context manager that
    does nothing, and with nothing recording the calls, Lightning leaves out the callback hooks that are Callback's
    own empty ones (training/private_api.py). Any other profiler sees every call as before.
    """

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        super().setup(stage, local_rank, log_dir)
        skip_hooks_not_overridden(lambda trainer: isinstance(trainer.profiler, NoProfiler))

    def profile(self, action_name: str) -> AbstractContextManager:
        return NOTHING


class ScheduledProfiler(PyTorchProfiler):
    """Records a few steps of each stage (training, validation, ...) with ``torch.profiler``.

    In each stage it skips ``skip_first + wait`` steps, warms up for ``warmup`` steps and records the
    next ``active`` ones, once. Every process writes a Chrome/TensorBoard trace,
    ``<stage>-<filename>-<local rank>-<step name>.<ns>.pt.trace.json``, to the run's log directory
    (``logs/<name>/<run id>/``), and a table of the slowest operations to ``<stage>-<filename>-<local rank>.txt``
    (without the rank part in a single process). ``PyTorchProfiler`` takes these options only as Python
    keyword arguments, which a config file cannot give it.

    Args:
        wait: steps to skip before warming up, after ``skip_first``.
        warmup: steps the profiler runs without keeping the results (its start-up cost lands here).
        active: steps recorded into the trace.
        skip_first: steps to skip at the start, e.g. to step over a slow first batch.
        record_shapes: record the input shapes of every operation.
        profile_memory: record tensor memory allocated and freed by every operation.
        with_stack: record the Python stack of every operation (large traces).
        dirpath: where to write; default: the logger's run directory.
        filename: name part of the files.
        row_limit: rows of the summary table.
        sort_by_key: column the summary table is sorted by, e.g. ``cpu_time_total``.
    """

    def __init__(
        self,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        skip_first: int = 0,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        dirpath: str | None = None,
        filename: str = "profile",
        row_limit: int = 20,
        sort_by_key: str | None = None,
    ) -> None:
        for name in ("wait", "warmup", "skip_first"):
            if locals()[name] < 0:
                raise ValueError(f"trainer.profiler.{name} must be >= 0, got {locals()[name]}")
        if active < 1:
            raise ValueError(f"trainer.profiler.active must be >= 1, got {active}")
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            row_limit=row_limit,
            sort_by_key=sort_by_key,
            schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, skip_first=skip_first),
            record_shapes=record_shapes,
            profile_memory=profile_memory,
            with_stack=with_stack,
        )

    def __del__(self) -> None:
        # When __init__ rejected its arguments, the base class never set up what its __del__ tears down.
        if hasattr(self, "_stage"):
            super().__del__()
