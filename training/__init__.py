from training.checkpoint_io import AtomicCheckpointIO
from training.early_stopping import StayStopped
from training.elastic import GlobalBatch
from training.last_checkpoint import LastCheckpoint
from training.mlflow_logger import MLFlowLogger
from training.monitor_check import MonitorCheck
from training.prediction_writer import PredictionWriter, Seq2SeqPredictionWriter
from training.preemption import PreemptionCheckpoint
from training.profiler import ScheduledProfiler
from training.progress_bar import ProgressBar
from training.resume import ResumeReport
from training.rng import RNGStateCheckpoint
from training.run_lock import RunLock
from training.startup import StartupError
from training.strategy import DDPStrategy
from training.unused_parameters import UnusedParameterCheck

__all__ = [
    "AtomicCheckpointIO",
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
    "StartupError",
    "UnusedParameterCheck",
]
