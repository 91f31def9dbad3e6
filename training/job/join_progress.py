"""What a process of a starting job says while it waits for the others: who joined, who has not, for how long."""

import shutil
import sys
from datetime import timedelta
from typing import Any

# A wait says whom it waits for once it has lasted QUIET_FOR seconds (a job whose processes all come at once
# prints nothing): redrawn every second on a terminal, else a line every REPORT_EVERY seconds.
QUIET_FOR = 5.0
REPORT_EVERY = 30.0


class WaitReport:
    """Says on stderr whom a process still waits for, once the wait lasts QUIET_FOR seconds: in place every
    second on a terminal, else one line every REPORT_EVERY seconds, so a log file gets no flood."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.due = QUIET_FOR
        self.drawn = False

    def show(self, waited: float, text: str) -> None:
        """Show ``text``, a report due ``waited`` seconds into the wait."""
        self.due = waited + (1 if self.tty else REPORT_EVERY)
        if self.tty:  # one row, or the carriage return would redraw only its last
            sys.stderr.write("\r" + text[: shutil.get_terminal_size().columns - 1] + "\033[K")
            self.drawn = True
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


def waited_of(waited: float, timeout: timedelta, setting: str = "join_timeout") -> str:
    return f"{timedelta(seconds=int(waited))} waited of {setting} {timeout}"


def waiting(
    arrived: dict[tuple[int, int], Any], num_nodes: int, devices: int, waited: float, timeout: timedelta, address: str
) -> str:
    """What global rank 0 says while it waits; ``arrived`` maps (node rank, local rank) to the Member that came."""
    nodes = sorted({node for node, _ in arrived})
    joined = [
        f"node {node} ({next(m.host for (n, _), m in arrived.items() if n == node)}) "
        f"{sum(n == node for n, _ in arrived)} of {devices}"
        for node in nodes
    ]
    absent = [str(node) for node in range(num_nodes) if node not in nodes]
    missing = (
        f"; node rank{'s' if len(absent) > 1 else ''} {', '.join(absent)} not yet (the job has num_nodes={num_nodes}: "
        "for fewer nodes, set trainer.num_nodes or NUM_NODES)"
        if absent
        else ""
    )
    return (
        f"Waiting at {address} for the job's processes: {len(arrived)} of {num_nodes * devices} joined "
        f"({', '.join(joined)}){missing}; {waited_of(waited, timeout)}."
    )
