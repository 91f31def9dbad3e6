from training.callbacks.early_stopping import StayStopped
from training.callbacks.monitor_check import MonitorCheck
from training.callbacks.prediction_writer import PredictionWriter, Seq2SeqPredictionWriter
from training.callbacks.progress_bar import ProgressBar
from training.callbacks.unused_parameters import UnusedParameterCheck
from training.checkpoints.atomic_io import AtomicCheckpointIO
from training.checkpoints.last import LastCheckpoint
from training.checkpoints.preemption import PreemptionCheckpoint
from training.checkpoints.resume import ResumeReport
from training.checkpoints.rng_state import RNGStateCheckpoint
from training.job.elastic import GlobalBatch
from training.job.startup import StartupError
from training.run.csv_logger import CSVLogger
from training.run.lock import RunLock
from training.run.mlflow_logger import MLFlowLogger
from training.run.profiler import ScheduledProfiler
from training.step_time.callback import StepTime
from training.strategy import DDPStrategy

__all__ = [
    "AtomicCheckpointIO",
    "CSVLogger",
    "DDPStrategy",
    "GlobalBatch",
    "LastCheckpoint",
    "MLFlowLogger",
    "MonitorCheck",
    "PredictionWriter",
    "PreemptionCheckpoint",
    "ProgressBar",
    "RNGStateCheckpoint",
    "RunLock",
    "ResumeReport",
    "ScheduledProfiler",
    "Seq2SeqPredictionWriter",
    "StayStopped",
    "StepTime",
    "StartupError",
    "UnusedParameterCheck",
]
