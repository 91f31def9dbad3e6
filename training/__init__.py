"""What the template adds to Lightning, by the names the configs give (``training.DDPStrategy``, ...).

Each name is imported when it is first asked for: cli.py takes the stop signals from ``training.job.early`` before
torch and Lightning are imported, which takes seconds.
"""

import importlib
from typing import Any

WHERE = {
    "AtomicCheckpointIO": "training.checkpoints.atomic_io",
    "CSVLogger": "training.run.csv_logger",
    "DDPStrategy": "training.strategy",
    "FiniteLoss": "training.callbacks.finite_loss",
    "GlobalBatch": "training.job.elastic",
    "LastCheckpoint": "training.checkpoints.last",
    "MLFlowLogger": "training.run.mlflow_logger",
    "MonitorCheck": "training.callbacks.monitor_check",
    "NoProfiler": "training.run.profiler",
    "PredictionWriter": "training.callbacks.prediction_writer",
    "PreemptionCheckpoint": "training.checkpoints.preemption",
    "ProgressBar": "training.callbacks.progress_bar",
    "RNGStateCheckpoint": "training.checkpoints.rng_state",
    "ResumeReport": "training.checkpoints.resume",
    "RunLock": "training.run.lock",
    "ScheduledProfiler": "training.run.profiler",
    "Seq2SeqPredictionWriter": "training.callbacks.prediction_writer",
    "StartupError": "training.job.startup",
    "StayStopped": "training.callbacks.early_stopping",
    "StepTime": "training.step_time.callback",
    "UnsizedEpochResume": "training.checkpoints.unsized_epoch",
    "UnusedParameterCheck": "training.callbacks.unused_parameters",
}
__all__ = sorted(WHERE)


def __getattr__(name: str) -> Any:
    if name not in WHERE:
        raise AttributeError(f"module 'training' has no attribute {name!r}")
    return getattr(importlib.import_module(WHERE[name]), name)
