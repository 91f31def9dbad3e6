"""Lightning's PyTorchProfiler with torch.profiler's schedule and recording options as arguments a YAML file can set."""

import torch
from lightning.pytorch.profilers import PyTorchProfiler


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
