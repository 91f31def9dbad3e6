"""The job's TCPStore at MASTER_ADDR:MASTER_PORT, which the start-up handshake, the process group and the heartbeat
share: global rank 0 serves it (under torchrun the agent does), every other process is a client."""

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore

from training.job.early import own_local_rank
from training.job.join_progress import WaitReport, waited_of
from training.job.startup import StartupError


def connect(
    host: str, port: int, leader: bool, timeout: timedelta, node: str, abandoned: Callable[[], str] = str
) -> Store:
    """The store, served by this process when it is the ``leader`` (global rank 0) outside torchrun; a port that is
    taken or a master that cannot be reached in time (``timeout``, or CONNECT_TIMEOUT: master_wait) is a
    StartupError naming ``node`` and the fix.
    ``abandoned`` says why this process stops waiting for the master before then ("" while it waits on)."""
    address = f"{host}:{port}"
    prefix = attempt_prefix()
    serve = leader and prefix is None
    if not serve:
        _await_master(host, port, *master_wait(timeout), node, abandoned)
    try:
        store = TCPStore(host, port, is_master=serve, timeout=timeout, wait_for_workers=False)
    except RuntimeError as error:
        if serve:
            raise StartupError(
                f"global rank 0 cannot listen on {address}: {error}. Another job (or an earlier run still "
                "shutting down) holds the port: stop it, or choose another MASTER_PORT on every node."
            ) from error
        raise StartupError(_unreachable(node, address, f"within {timeout}", f": {error}")) from error
    return PrefixStore(prefix, store) if prefix else store


def master_wait(join_timeout: timedelta) -> tuple[timedelta, str]:
    """How long a process waits for the master's port to open, and the setting that says so: ``CONNECT_TIMEOUT``
    seconds (scripts/cluster.env's, which the launcher exports) where it is set and shorter, else join_timeout."""
    given = os.environ.get("CONNECT_TIMEOUT", "")
    if not given:
        return join_timeout, "join_timeout"
    if not given.isdigit():
        raise StartupError(
            f"CONNECT_TIMEOUT={given} is not a number of seconds. Fix it in scripts/cluster.env or the environment."
        )
    connect_timeout = timedelta(seconds=int(given))
    return (connect_timeout, "CONNECT_TIMEOUT") if connect_timeout < join_timeout else (join_timeout, "join_timeout")


def _await_master(
    host: str, port: int, timeout: timedelta, setting: str, node: str, abandoned: Callable[[], str]
) -> None:
    """Knock on the master's port until it answers: TCPStore's own wait cannot be interrupted (a stop signal, the
    end of the process that started this one) and prints a C++ trace for each of its retries."""
    report = WaitReport() if own_local_rank() == 0 else None
    started = time.monotonic()
    try:
        while True:
            try:
                with socket.create_connection((host, port), timeout=1):
                    return
            except socket.gaierror as error:
                raise StartupError(
                    f"{node} cannot resolve the master's address {host} ({error.strerror}): set MASTER_ADDR to the "
                    "master's host name or IP address, the same on every node."
                ) from None
            except OSError:
                pass
            if why := abandoned():
                raise StartupError(why)
            waited = time.monotonic() - started
            if waited > timeout.total_seconds():
                raise StartupError(_unreachable(node, f"{host}:{port}", f"after {setting} {timeout}", ""))
            if report and report.due <= waited:
                report.show(
                    waited, f"{node} waits for the master at {host}:{port}: {waited_of(waited, timeout, setting)}."
                )
            time.sleep(0.1)
    finally:
        if report:
            report.close()


def _unreachable(node: str, address: str, waited: str, error: str) -> str:
    port = address.rsplit(":", 1)[1]
    return (
        f"{node} cannot reach the master at {address} {waited}{error}. Check that node 0 is running, that every "
        "node uses the same MASTER_ADDR and MASTER_PORT, and that the master's firewall lets this node reach that "
        f"port (e.g. sudo ufw allow {port}/tcp); then run the same command on every node again. Nothing was trained."
    )


def attempt_prefix() -> str | None:
    """Under torchrun every process is a client of the agent's store, which outlives a restart of the workers: a
    fresh prefix per attempt keeps the new workers from reading the dead ones' keys."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def address_towards(host: str, port: int) -> str:
    """This machine's address on the way to ``host`` (no packet is sent), or "" if there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return probe.getsockname()[0]
    except OSError:
        return ""
