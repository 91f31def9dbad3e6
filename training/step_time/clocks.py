"""Clocks that time a step without waiting for it, and the DDP hook that times the wait in the gradient allreduce.

On a GPU, kernels run after the Python that queued them has moved on: a CPU clock would time how fast steps are
queued, and reading a GPU clock at once would wait for the GPU in every step. CUDA events are recorded in the step
and read a step or more later, once the GPU has passed them.
"""

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class CpuClock:
    """Stamps are ``time.perf_counter()``, ready at once."""

    def stamp(self) -> float:
        return time.perf_counter()

    def ready(self, stamp: float) -> bool:
        return True

    def settle(self, stamp: float) -> None:
        pass

    def ms(self, start: float, end: float) -> float:
        return 1e3 * (end - start)


class CudaClock:
    """Stamps are CUDA events recorded on the current stream; one is ready once the GPU has passed it."""

    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, stamp: torch.cuda.Event) -> bool:
        return stamp.query()

    def settle(self, stamp: torch.cuda.Event) -> None:
        """Wait for one event: at the end of fit only."""
        stamp.synchronize()

    def ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)


Clock = CpuClock | CudaClock


@dataclass
class Step:
    """The stamps of one training step: the end of the step before, its start (the batch fetched and on the
    device), its end, and when its last gradient bucket was handed to the allreduce and came back (None without
    DDP, or in a step that accumulated gradients without synchronising)."""

    previous_end: Any
    start: Any
    end: Any
    handed: Any
    done: Any
    samples: int

    def ready(self, clock: Clock) -> bool:
        return clock.ready(self.end) and (self.done is None or clock.ready(self.done))

    def parts(self, clock: Clock) -> dict[str, float]:
        """Milliseconds waiting for data, computing and waiting in the allreduce; together the whole step."""
        busy = clock.ms(self.start, self.end)
        collective = 0.0
        if self.handed is not None and self.done is not None:
            # Once the last bucket is handed over, the backward pass has nothing left to compute: until it comes
            # back, this process waits for the slowest peer (and the transfer).
            collective = min(max(clock.ms(self.handed, self.done), 0.0), busy)
        return {"data": clock.ms(self.previous_end, self.start), "compute": busy - collective, "collective": collective}


class CollectiveWait:
    """A DDP communication hook: DDP's default allreduce of each gradient bucket, stamping when the last bucket of a
    step was handed over and when its allreduce completed. DDP reduces the buckets in order, so the last one's
    return is the end of the step's communication."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.handed: Any = None
        self.done: Any = None

    def allreduce(self, state: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if not bucket.is_last():
            return default_hooks.allreduce_hook(state, bucket)
        self.handed = self.clock.stamp()
        future = default_hooks.allreduce_hook(state, bucket)

        def completed(reduced: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            # On a GPU this runs on a stream that waits for the allreduce: the event marks its end on the GPU.
            self.done = self.clock.stamp()
            return reduced.value()

        return future.then(completed)

    def take(self) -> tuple[Any, Any]:
        """The stamps of the step that just ended, which DDP waited for before the backward pass returned."""
        stamps = self.handed, self.done
        self.handed = self.done = None
        return stamps
