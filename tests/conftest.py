import contextlib
import os
import signal
import sys

import pytest

# torch, Lightning and the project's modules are imported where they are used: pytest-xdist's controller loads this
# file too, runs no test, and would only wait seconds for them before starting the workers.


def pytest_configure(config):
    # A script's background command starts with SIGINT ignored, and so would every process the tests start
    # if pytest ran as one: a launcher cannot trap a signal that was ignored when it started.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Where the environment sets PYTHONDONTWRITEBYTECODE (some images do), every one of the suite's 600 or so Python
    # processes would compile the project's modules again, about 0.05 s of CPU each: the processes the tests start
    # (pytest-xdist's workers included) write bytecode as Python does by default, into __pycache__, which git ignores.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    # The workers of pytest-xdist share the cores; with torch's thread per core in each, there are more threads
    # than cores, and an operation keeps waiting for a thread that is not running. What the tests start keeps
    # torch's default.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // int(workers)))


# The files that take longest start first, so that the quick ones fill the cores while the last long one ends:
# the fast tier's longest (launcher cases that each parse the config, heartbeat tests that wait out short
# timeouts, in-process CLI runs; a minute at most), then the files whose jobs take a minute or more, longest
# first (as measured in a full run). pytest-xdist hands a worker whole files in collection order
# (--no-loadscope-reorder: its own order, most tests first, started these few-test files last, and the run ended
# with one of them alone on the machine).
LONGEST_FIRST = (
    "test_launcher_checks.py",
    "test_liveness.py",
    "test_cli.py",
    "test_everyday_stops.py",
    "test_elastic.py",
    "test_launcher.py",
    "test_cluster_launch.py",
    "test_doctor.py",
    "test_lost_node.py",
    "test_fault_tolerance.py",
    "test_zoo_optimization.py",
    "test_zoo_monitoring.py",
    "test_zoo_transformers.py",
    "test_stall_outside_training.py",
    "test_bench.py",
    "test_streaming_ddp.py",
    "test_k8s.py",
    "test_startup.py",
    "test_step_time.py",
)


def pytest_collection_modifyitems(items):
    distributed = {item.path.name for item in items if item.get_closest_marker("distributed")}

    def start(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        if name in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(name)
        return (1, 0) if name in distributed else (2, 0)

    items.sort(key=start)  # stable: each file's tests stay together and in order


@pytest.fixture(autouse=True)
def environment_restored():
    """Lightning's launcher writes LOCAL_RANK, MASTER_PORT, OMP_NUM_THREADS, ... into the environment of the process
    that runs it. After an in-process run, every job a later test of this worker starts would inherit them: its
    rank 0, finding LOCAL_RANK, would start no other process and wait for them until its join timeout."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(tmp_path_factory):
    """A failed test may leave a launch training; stop it before it slows down every test after it."""
    from tests.helpers import processes_in

    yield
    for pid in processes_in(tmp_path_factory.getbasetemp()):
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def run_cli(tmp_path, monkeypatch):
    """Run cli.main in-process, as ``python cli.py ARGS`` from ``tmp_path``."""
    import torch

    import cli

    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> cli.CLI:
        monkeypatch.setattr(sys, "argv", ["cli.py", *args])
        return cli.main()

    precision = torch.get_float32_matmul_precision()  # the config sets it for the whole process
    yield run
    torch.set_float32_matmul_precision(precision)


@pytest.fixture
def process_group_alone():
    """A gloo process group of this pytest process alone, enough to build a DistributedDataParallel in-process. It
    ends after the test has let go of its wrapper: a wrapper freed after the group was destroyed drops the group's
    last reference with the GIL held, and the group's destructor waits, for good, for a gloo worker thread that needs
    the GIL (training/job/process_group.py)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: separate hosts with their own addresses and interfaces."""
    from tests.helpers.hosts import network_namespaces

    with network_namespaces(f"{os.getpid() % 100000}") as hosts:
        yield hosts


@pytest.fixture(scope="module")
def two_hosts_for_module():
    """The same two hosts for every test of a module that shares one run."""
    from tests.helpers.hosts import network_namespaces

    with network_namespaces(f"{os.getpid() % 100000}m") as hosts:
        yield hosts
