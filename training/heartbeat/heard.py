"""What one process has heard of the job's heartbeats (training/heartbeat/liveness.py), and which silences say
something."""

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Heard:
    """The latest heartbeat of one process, and when it last changed (monotonic and wall clock)."""

    beat: dict[str, Any]
    changed: float
    changed_at: float = field(default_factory=time.time)


class Hearing:
    """The latest heartbeat of each process and when the store last answered, as the heartbeat thread saw them.

    A peer's silence only counts while the store answers: with no fresh news of the store, nobody's silence
    says anything of them (the store's own silence is the news).
    """

    def __init__(self, world_size: int, period: float) -> None:
        self.world_size = world_size
        self.period = period
        self.started = time.monotonic()
        self.peers: dict[int, Heard] = {}
        self.store = self.started
        self.store_at = time.time()

    def answered(self, beats: dict[int, dict[str, Any]]) -> None:
        """The store answered with ``beats``, the latest heartbeat of each process that has sent one."""
        self.store, self.store_at = time.monotonic(), time.time()
        for rank, beat in beats.items():
            previous = self.peers.get(rank)
            if previous is None or previous.beat.get("count") != beat.get("count"):
                self.peers[rank] = Heard(beat, time.monotonic())

    def resumed(self, now: float) -> None:
        """This process did not run for a while (suspended with its job, or starved of CPU): what it heard before
        says nothing of the time it missed, so every silence counts from ``now``."""
        self.started = self.store = now
        for peer in self.peers.values():
            peer.changed = now

    def fresh(self, now: float) -> bool:
        """Whether the store answered within the last two periods."""
        return now - self.store <= 2 * self.period

    def silent(self, now: float, silence: float) -> dict[int, Heard | None]:
        """The processes still running that have not beaten for ``silence`` seconds (None: never heard from,
        counted from when this process started listening)."""
        peers = dict(self.peers)
        return {
            rank: peers.get(rank)
            for rank in range(self.world_size)
            if (now - self.started > silence if rank not in peers else self._quiet(peers[rank], now, silence))
        }

    def falling(self, since: float, now: float) -> bool:
        """Whether a process whose beats stopped after ``since`` is still running: it may yet reach a silence."""
        peers = list(self.peers.values())
        return any(peer.changed >= since and self._quiet(peer, now, 2 * self.period) for peer in peers)

    @staticmethod
    def _quiet(peer: Heard, now: float, silence: float) -> bool:
        return peer.beat.get("state") != "done" and now - peer.changed > silence
