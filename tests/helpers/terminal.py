"""A terminal for a test's job, to close as a window closes."""

import fcntl
import os
import pty
import select
import signal
import termios
import threading
from pathlib import Path


class Terminal:
    """A pseudo-terminal as the controlling terminal of a new session, its output copied to ``output``."""

    def __init__(self, output: Path) -> None:
        self.master, self.slave = pty.openpty()
        self.output = output.open("wb")
        self.closed = threading.Event()
        self.reader = threading.Thread(target=self.copy, daemon=True)
        self.reader.start()

    def take_control(self) -> None:
        """In the new process, a session leader: the terminal becomes its controlling terminal and standard streams.
        SIGHUP does what it does in a job a terminal's shell starts, even where the tests run under ``nohup``, whose
        ignored SIGHUP the job would otherwise inherit and keep (training/job/early.py keeps an ignored signal)."""
        fcntl.ioctl(self.slave, termios.TIOCSCTTY, 0)
        for fd in (0, 1, 2):
            os.dup2(self.slave, fd)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)

    def copy(self) -> None:
        while not self.closed.is_set():
            if select.select([self.master], [], [], 0.1)[0]:
                try:
                    self.output.write(os.read(self.master, 65536))
                except OSError:
                    return
                self.output.flush()

    def close(self) -> None:
        """As a terminal window closes: the kernel hangs up the terminal (SIGHUP to its session leader), and the shell
        passes SIGHUP on to its job's process group."""
        self.closed.set()
        self.reader.join()
        os.close(self.master)
