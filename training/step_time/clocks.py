"""Clocks that time a step without waiting for it, and the stamp that splits the wait in the gradient allreduce off.

On a GPU, kernels run after the Python that queued them has moved on: a CPU clock would time how fast steps are
queued, and reading a GPU clock at once would wait for the GPU in every step. CUDA events are recorded in the step
and read a step or more later, once the GPU has passed them.
"""

import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch


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
    device), its end, and when its last gradient was computed and its backward pass returned, DDP's allreduce
    done (None without DDP)."""

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
            # Once the last gradient is computed, the backward pass has nothing left to compute: until it returns,
            # this process waits in the allreduce for the slowest peer (and the transfer).
            collective = min(max(clock.ms(self.handed, self.done), 0.0), busy)
        return {"data": clock.ms(self.previous_end, self.start), "compute": busy - collective, "collective": collective}


class GradientsReady:
    """Stamps when this process has computed the last gradient of a backward pass: from then on, until the
    backward pass returns, it only waits for DDP's allreduce, that is for the slowest peer (and the transfer).

    DDP's own allreduce stays as it is (a communication hook in Python would cost the step more than the 1% this
    measurement may take): a hook on each parameter's accumulated gradient finds, in the first step, the one that is
    computed last; only its hook stays, one Python call a step. A step where that parameter gets no gradient has
    no stamp, and its wait counts as compute.
    """

    def __init__(self, clock: Clock, parameters: list[torch.nn.Parameter]) -> None:
        self.clock = clock
        self.stamp: Any = None
        self.last = -1
        self.hooks = {
            index: parameter.register_post_accumulate_grad_hook(partial(self.ready, index))
            for index, parameter in enumerate(parameters)
            if parameter.requires_grad
        }

    def ready(self, index: int, parameter: torch.nn.Parameter) -> None:
        self.stamp = self.clock.stamp()
        self.last = index

    def take(self) -> Any:
        """The stamp of the backward pass that just ended, or None."""
        stamp, self.stamp = self.stamp, None
        if stamp is not None and len(self.hooks) > 1:
            for index, hook in self.hooks.items():
                if index != self.last:
                    hook.remove()
            self.hooks = {self.last: self.hooks[self.last]}
        return stamp

    def remove(self) -> None:
        for hook in self.hooks.values():
            hook.remove()
        self.hooks = {}
