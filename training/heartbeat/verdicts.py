"""What one process concludes from the heartbeats it has heard (training/heartbeat/heard.py) and from its own node's
processes (training/job/node_processes.py): a peer or the store silent for too long, a peer that stopped the job or
stopped with an error, a process of this node that ended, a process that makes no progress; and the paragraph that
says so (training/heartbeat/why_stopped.py). training/heartbeat/liveness.py sends and hears the heartbeats and stops
the job.
"""

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from training.heartbeat import why_stopped
from training.heartbeat.heard import Hearing
from training.heartbeat.stall import SAVING_A_CHECKPOINT, stalled
from training.job.node_processes import NodeProcesses
from training.run import storage_failure
from training.run.out_of_memory import out_of_memory

# After a failed collective, a peer silent this long (or peer_timeout, if shorter) is the one that failed.
FAILURE_GRACE = timedelta(seconds=10)


class Verdicts:
    """What Liveness (training/heartbeat/liveness.py) concludes from what it has heard; it sets the attributes below."""

    hearing: Hearing
    me: dict[str, Any]
    node: NodeProcesses | None
    peer_timeout: timedelta
    period: float
    store_address: str
    describe: dict[str, Any]
    progress: Callable[[], tuple[int, int] | None]
    checkpoint: dict[str, Any] | None
    stall_report: timedelta
    stall_timeout: timedelta
    reported: dict[int, tuple[int, str]]  # a stalled process's rank -> its batches and what it was doing, once said
    trainer_fn: str  # the subcommand's Trainer function: fit, validate, test or predict

    def failed(self, error: BaseException) -> str | None:
        """The paragraph for a collective that failed with ``error``, or None where nothing explains it.

        A peer that was killed fails gloo at once, before its silence shows: wait up to FAILURE_GRACE for a
        peer to fall silent or report its own error. If all kept answering, a timeout is the collective's own.
        """
        grace = min(FAILURE_GRACE, self.peer_timeout).total_seconds()
        failed_at = time.monotonic()
        why = f"and a collective with it failed ({why_stopped.one_line(error)}), so this node stopped"
        while not (paragraph := self.verdict(grace, why, failed=True)) and not self._told(failed_at, grace):
            time.sleep(min(self.period, 0.5))
        if paragraph:
            return paragraph
        if not why_stopped.timed_out(error):
            return None
        timeout = self.describe["collective_timeout"]
        limit = f"the collective timeout ({timeout})"
        seconds = self.stall_report.total_seconds() or timeout.total_seconds()
        stall = self._stall(self._running(), seconds, limit)  # the process the collective waited for
        return stall or why_stopped.collective_timeout(error, timeout, self._tail(None))

    def own_failure(self, error: BaseException, trainer: Any) -> str | None:
        """The paragraph for this process's own ``error`` in ``trainer``'s run where it is no bug: the run's directory
        deleted or on a full disk, an allocation that did not fit in memory; else None (``trainer``: None before one
        runs)."""
        progress = self.progress()
        reached = f"This node had reached epoch {progress[0]}, step {progress[1]}." if progress else ""
        run = storage_failure.run_of(trainer)
        stage = trainer.state.stage.value if trainer is not None and trainer.state.stage is not None else None
        return storage_failure.failed_run(
            error, run, reached, self.describe["command"], self._tail(None)
        ) or out_of_memory(error, why_stopped.who(self.me), stage)

    def _told(self, failed_at: float, grace: float) -> bool:
        """Whether the heartbeats since a collective failed at ``failed_at`` have said all they will: ``grace`` and
        two periods have passed, this process has fresh news of the store, and no peer whose beats stopped after
        the failure is still short of ``grace`` (a loaded machine hears a peer's last beat late). At the latest
        after a further peer_timeout."""
        now = time.monotonic()
        if now - failed_at > grace + 2 * self.period + self.peer_timeout.total_seconds():
            return True
        over = now - failed_at >= grace + 2 * self.period
        return over and self.hearing.fresh(now) and not self.hearing.falling(failed_at, now)

    def verdict(self, silence: float, why: str, failed: bool = False) -> str | None:
        """The paragraph if a peer stopped the job, or (with ``failed``, after a collective failed) ended with
        an error, or if a peer or the store has been silent for ``silence`` seconds (``why`` says what that
        means); else None."""
        now = time.monotonic()
        heard = dict(self.hearing.peers)
        if self.node and (killed := self.node.ended(killed_only=True)):
            return why_stopped.process_ended(killed, self._tail(None))
        for peer in heard.values():
            if peer.beat.get("state") == "stopping":  # the same paragraph on every node, each with its own command
                return why_stopped.with_command(peer.beat["verdict"], self.describe["command"])
        for peer in heard.values() if failed else ():
            if peer.beat.get("state") == "failed":
                return why_stopped.peer_failed(peer.beat, peer.beat["error"], self._tail(None))
        store_silent = now - self.hearing.store > silence
        if (failed or store_silent) and self.node and (starter := self.node.starter_ended()):
            return why_stopped.process_ended(starter, self._tail(None))
        silent_peers = self.hearing.fresh(now) and self.hearing.silent(now, silence)
        if (store_silent or silent_peers) and self.node and (frozen := self.node.frozen()):
            return why_stopped.process_frozen(frozen, why, self._tail(None))
        if store_silent:
            zero = heard[0].beat if 0 in heard else {}
            if zero.get("state") == "done":  # the job ended: global rank 0, and its store, are gone
                return None
            return why_stopped.store_lost(zero, self.store_address, self.hearing.store_at, why, self._tail("node 0"))
        if not self.hearing.fresh(now):
            return None
        silent = self.hearing.silent(now, silence)
        if not silent:
            return None
        nodes = {peer.beat["node"] for peer in silent.values() if peer is not None}
        whole = [node for node in sorted(nodes) if all(r in silent for r, p in heard.items() if p.beat["node"] == node)]
        lost = " and ".join(f"node {node}" for node in whole) or None
        return why_stopped.peers_lost(silent, {rank: peer.beat for rank, peer in heard.items()}, why, self._tail(lost))

    def _tail(self, lost: str | None) -> str:
        zero = self.hearing.peers.get(0)
        checkpoint = self.checkpoint or (zero.beat.get("checkpoint") if zero else None)
        command, nodes = self.describe["command"], self.describe["nodes"]
        return why_stopped.tail(lost, self.progress(), checkpoint, command, self.trainer_fn, nodes)

    def stalls(self) -> tuple[list[str], str | None]:
        """The reports of the processes that have made no progress for stall_report, each said once per stall, and
        the paragraph that stops the job once one of them has made none for stall_timeout (None: not yet)."""
        beats = self._running()
        reports = []
        for rank, what in stalled(beats, self.stall_report.total_seconds()).items():
            if self.reported.get(rank) != (beats[rank]["batches"], what):
                self.reported[rank] = (beats[rank]["batches"], what)
                timeouts = self.stall_timeout, self.describe["collective_timeout"]
                reports.append(why_stopped.stall_report(beats[rank], what, *timeouts))
        limit = f"stall_timeout ({self.stall_timeout})"
        return reports, self._stall(beats, self.stall_timeout.total_seconds(), limit) if self.stall_timeout else None

    def _stall(self, beats: dict[int, dict[str, Any]], seconds: float, limit: str) -> str | None:
        """The paragraph that stops the job at ``limit`` for a process of ``beats`` (``_running``) that has made no
        progress for ``seconds`` (saving a checkpoint aside), or None."""
        for rank, what in stalled(beats, seconds).items():
            if what != SAVING_A_CHECKPOINT:
                return why_stopped.stalled(beats[rank], what, limit, self._tail(None))
        return None

    def _running(self) -> dict[int, dict[str, Any]]:
        """The last heartbeat of each process heard running (from a copy: the heartbeat's thread adds the ranks)."""
        return {
            rank: peer.beat for rank, peer in dict(self.hearing.peers).items() if peer.beat.get("state") == "running"
        }
