from training.checkpoint_io import AtomicCheckpointIO
from training.preemption import PreemptionCheckpoint
from training.rng import RNGStateCheckpoint
from training.startup import StartupError
from training.strategy import DDPStrategy

__all__ = ["AtomicCheckpointIO", "DDPStrategy", "PreemptionCheckpoint", "RNGStateCheckpoint", "StartupError"]
