"""The arithmetic of step times: each node's share of a step, the slow node over a window of steps, the paragraph
that names it and the scaling summary at the end of fit. Plain numbers in, plain numbers and text out."""

import statistics
from collections import deque
from dataclasses import dataclass

PARTS = ("data", "compute", "collective")
# What each process sums over the steps it measured, the parts in milliseconds; and the steps it left out.
FIELDS = ("steps", "samples", *PARTS, "left_out")
# A step whose computation takes this many times the median of the steps before it compiles (torch.compile, a new
# shape that makes it compile again) or warms up (autotuning, first allocations): the figures leave it out.
COMPILING = 10

CAUSES = {
    "data": (
        "A node waits for data when its data loader cannot keep up: too few loader workers (the data module's "
        "num_workers) or torch threads for the work per batch, fewer CPU cores than the other nodes (nproc), other "
        "work on its CPUs (top), slower storage, or long work between steps (callbacks, logging)."
    ),
    "compute": (
        "A node computes slower when its device runs at lower clocks or is throttled (nvidia-smi -q -d "
        "CLOCK,PERFORMANCE names the reason), is another device model than the others' (nvidia-smi -L), or shares "
        "its device or CPU cores with other work (nvidia-smi, top); on CPUs, fewer cores or threads (nproc)."
    ),
}
WHAT = {"data": "waiting for data", "compute": "computing (forward, backward, optimizer)"}


@dataclass(frozen=True)
class Node:
    rank: int
    host: str
    address: str

    def __str__(self) -> str:
        return f"node {self.rank} ({self.host}, {self.address or 'address unknown'})"


def per_node(rows: list[list[float]], nodes: list[int]) -> dict[int, dict[str, float]]:
    """Each node's mean milliseconds per step of each part and in all (``step``), the mean over its processes, with
    the node's ``steps`` and ``samples`` summed. ``rows`` holds each process's FIELDS, ``nodes`` its node rank; a
    node whose processes measured no step is left out."""
    figures = {}
    for node in sorted(set(nodes)):
        measured = [dict(zip(FIELDS, row, strict=True)) for row, n in zip(rows, nodes, strict=True) if n == node]
        measured = [m for m in measured if m["steps"] > 0]
        if not measured:
            continue
        mean = {part: statistics.fmean(m[part] / m["steps"] for m in measured) for part in PARTS}
        figures[node] = {
            **mean,
            "step": sum(mean.values()),
            "steps": sum(m["steps"] for m in measured),
            "samples": sum(m["samples"] for m in measured),
        }
    return figures


@dataclass(frozen=True)
class Finding:
    """A node slower than the others in one part of the step: its ms per step, the others', and the ms per step
    the other nodes spent waiting in collectives, of their step."""

    node: int
    part: str
    mine: float
    others: float
    waiting: float
    others_step: float
    steps: int


class SlowNodeWatch:
    """Finds the node whose data or compute time stays above the others' over the last ``window`` steps.

    A node is slow in a part when its median over the window's log intervals is at least ``slower_by`` times the
    other nodes' and exceeds it by at least ``min_share`` of its step and by at least ``min_ms`` milliseconds: a
    spike (a checkpoint save, a busy second) moves one interval, not the median; a gap small beside the step is
    noise, and so is a gap of a few milliseconds in a short step, which is how long a busy CPU's scheduler keeps a
    process waiting. ``add`` returns a finding once per episode: again only after the nodes were back within the
    thresholds, or for another node or part.
    """

    def __init__(self, window: int, slower_by: float, min_share: float, min_ms: float) -> None:
        self.window = window
        self.slower_by = slower_by
        self.min_share = min_share
        self.min_ms = min_ms
        self.intervals: deque[tuple[int, dict[int, dict[str, float]]]] = deque()
        self.reported: tuple[int, str] | None = None

    def add(self, steps: int, figures: dict[int, dict[str, float]]) -> Finding | None:
        """One log interval of ``steps`` steps and its per_node figures."""
        self.intervals.append((steps, figures))
        while sum(s for s, _ in self.intervals) - self.intervals[0][0] >= self.window:
            self.intervals.popleft()
        if sum(s for s, _ in self.intervals) < self.window:
            return None
        finding = self.slowest()
        key = (finding.node, finding.part) if finding else None
        if key == self.reported:
            return None
        self.reported = key
        return finding

    def slowest(self) -> Finding | None:
        typical: dict[int, dict[str, float]] = {}
        for node in {node for _, figures in self.intervals for node in figures}:
            seen = [figures[node] for _, figures in self.intervals if node in figures]
            typical[node] = {key: statistics.median(f[key] for f in seen) for key in (*PARTS, "step")}
        found = []
        for node, mine in typical.items():
            others = [figures for other, figures in typical.items() if other != node]
            if not others:
                continue
            for part in ("data", "compute"):
                theirs = statistics.median(o[part] for o in others)
                excess = mine[part] - theirs
                if mine[part] >= self.slower_by * theirs and excess >= max(self.min_share * mine["step"], self.min_ms):
                    waiting = statistics.fmean(o["collective"] for o in others)
                    others_step = statistics.fmean(o["step"] for o in others)
                    found.append((excess, Finding(node, part, mine[part], theirs, waiting, others_step, self.window)))
        return max(found, key=lambda pair: pair[0])[1] if found else None


def paragraph(finding: Finding, where: dict[int, Node]) -> str:
    """The paragraph every node's log gets when a node holds the job back."""
    times = f"{finding.mine / finding.others:.1f} times" if finding.others > 0 else "far more than"
    share = finding.waiting / finding.others_step if finding.others_step > 0 else 0.0
    return (
        f"{where[finding.node]} is the slow node: over the last {finding.steps} steps it spent "
        f"{finding.mine:.1f} ms per step {WHAT[finding.part]}, {times} the other nodes' {finding.others:.1f} ms "
        f"({finding.mine - finding.others:+.1f} ms). Every step of the job waits for it: the other nodes spent "
        f"{finding.waiting:.1f} ms of their {finding.others_step:.1f} ms steps ({100 * share:.0f}%) waiting for it "
        f"in collectives. {CAUSES[finding.part]} Per-node figures: timing/node<N>/* in the run's logs."
    )


def summary(rows: list[list[float]], nodes: list[int], where: dict[int, Node], collectives_measured: bool) -> str:
    """The scaling summary at the end of fit, from every process's FIELDS summed over the whole fit."""
    measured = [dict(zip(FIELDS, row, strict=True)) for row in rows]
    measured = [m for m in measured if m["steps"] > 0]
    if not measured:
        return "Scaling summary: no training step was measured."
    seconds = [sum(m[part] for part in PARTS) / 1e3 for m in measured]
    rates = [m["samples"] / s if s > 0 else 0.0 for m, s in zip(measured, seconds, strict=True)]
    share = {part: statistics.fmean(m[part] / sum(m[p] for p in PARTS) for m in measured) for part in PARTS}
    step = statistics.fmean(1e3 * s / m["steps"] for m, s in zip(measured, seconds, strict=True))
    job = sum(rates)
    count = len(set(nodes))
    left_out = round(sum(row[FIELDS.index("left_out")] for row in rows))
    left = (
        f" Left out: {left_out} step{'s' if left_out > 1 else ''} whose computation took over {COMPILING} times the "
        "median step's (compilation by torch.compile, warm-up)."
        if left_out
        else ""
    )
    lines = [
        f"Scaling summary: {len(rows)} process{'es' if len(rows) > 1 else ''} on {count} node{'s' if count > 1 else ''}"
        f" trained {job:,.1f} samples/s, {statistics.fmean(rates):,.1f} per process; of a {step:.1f} ms step, "
        f"{100 * share['data']:.0f}% went to waiting for data, {100 * share['collective']:.0f}% to waiting in "
        f"collectives and {100 * share['compute']:.0f}% to computing"
        + ("" if collectives_measured else " (collective waits included, not measured apart without DDP)")
        + f". Without those waits the job would train {job / max(share['compute'], 1e-9):,.1f} samples/s."
        + left,
    ]
    for node, figures in per_node(rows, nodes).items():
        lines.append(
            f"  {where[node]}: {figures['data']:.1f} ms data, {figures['compute']:.1f} ms compute, "
            f"{figures['collective']:.1f} ms collectives per step"
        )
    return "\n".join(lines)
