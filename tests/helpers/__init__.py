"""Helpers for tests that run the project's entry points as real jobs: the CLI, the launcher as the nodes of a
cluster, and what their ranks recorded."""

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from data import RandomDataModule

REPO = Path(__file__).resolve().parents[2]
DDP_YAML = str(REPO / "configs" / "ddp.yaml")
# One process on one device, no process group: in-process runs stay in this pytest process, and a job whose checks a
# second process would not change starts no other.
SINGLE_PROCESS = ["--trainer.strategy=auto", "--trainer.devices=1"]


def needs_gpus(count: int = 1):
    """Put a test in the GPU tier (``pytest -m gpu``), skipped with the reason where fewer than ``count`` GPUs."""

    def mark(test):
        found = torch.cuda.device_count()
        reason = f"needs {count} CUDA GPU{'s' if count > 1 else ''}; this machine has {found}"
        return pytest.mark.gpu(pytest.mark.skipif(found < count, reason=reason)(test))

    return mark


def run_script(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 900):
    """Run a project entry point as a user would, with the repo importable and output captured."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, *args] if args[0].endswith(".py") else args,
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def made_once(requirements: Path, kind: str, make: Callable[[Path], None], holds: str) -> Path:
    """A directory ``make`` fills from ``requirements`` once per machine, in ~/.cache/lightning-ddp-template (or
    XDG_CACHE_HOME's), named by ``kind``, the Python version and the file's digest: a new clone does not make it
    again, a changed file or Python makes another, and one without ``holds`` inside is made again."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning-ddp-template"
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()[:12]
    made = cache / f"{kind}-py{sys.version_info.major}.{sys.version_info.minor}-{digest}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{made.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once make it once
        if not (made / holds).exists():
            partial = made.with_name(f"{made.name}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            make(partial)
            shutil.rmtree(made, ignore_errors=True)
            partial.rename(made)  # a half-made directory is never taken for a whole one
    return made


def pip_install(python: Path | str, *args: str) -> None:
    done = run_script(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args], REPO, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr


def installed_aside(requirements: str, modules: tuple[str, ...], needs: str) -> str:
    """A directory for the PYTHONPATH of a process that needs ``modules``, which the tests' environment leaves out so
    that no other process imports them: where this Python imports them already (a GPU machine's image often has
    matplotlib), the directories they come from; else ``requirements`` (which pins all they need beyond
    requirements-dev.txt) installed once into a directory of its own. ``needs`` says why, should pip fail."""
    found = [importlib.util.find_spec(module) for module in modules]
    if all(spec is not None and spec.origin is not None for spec in found):
        return os.pathsep.join(dict.fromkeys(str(Path(spec.origin).parents[1]) for spec in found))
    pins = REPO / requirements

    def make(target: Path) -> None:
        command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps"]
        done = run_script([*command, "--target", str(target), "-r", str(pins)], REPO, timeout=900)
        if done.returncode != 0:
            last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:]
            pytest.fail(
                f"{needs}, which {sys.executable} cannot import, and pip could not install {requirements} "
                f"({' '.join(last)}). Install it into this Python (pip install -r {requirements}; offline, from a "
                f"folder of wheels: pip install --no-index --find-links WHEELS -r {requirements}), or give pip an "
                "index it can reach.",
                pytrace=False,
            )

    return str(made_once(pins, requirements.removeprefix("requirements-").removesuffix(".txt"), make, modules[0]))


def charts_path() -> str:
    return installed_aside("requirements-charts.txt", ("matplotlib",), "this test draws a chart with matplotlib")


def s3_path() -> str:
    return installed_aside("requirements-s3-tests.txt", ("s3fs", "moto"), "this test serves S3 with moto and s3fs")


def transformers_path() -> str:
    return installed_aside("requirements-transformers-tests.txt", ("transformers",), "this test builds a GPT-2")


def copy_project(dest: Path) -> Path:
    """A node's own clone of the project (tracked and new files, no logs or caches), as on a real cluster."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    for name in filter(None, listed.stdout.split("\0")):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


# Ports for the tests' jobs and servers come from below the kernel's ephemeral range (32768 and up), which the
# clients' own connections draw from, each worker of pytest-xdist from a block of its own, each port once: a port the
# kernel hands out for port 0 is free only until the next test in another worker asks for one.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_FIRST_PORT = 20000 + 1000 * (_WORKER % 12)
_PORTS = iter(range(_FIRST_PORT, _FIRST_PORT + 1000))


def free_port() -> int:
    for port in _PORTS:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue  # a server of this machine's, or a port of this worker's still in TIME_WAIT
            return port
    raise AssertionError(f"pytest worker {_WORKER} used up its block of ports")


def launcher_env(**settings: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MASTER_", "NUM_NODES"))}
    return {**env, "PYTHON": sys.executable, **settings}


def launch(
    node: Path,
    gpus: str,
    rank: int | str,
    *extra: str,
    netns: str | None = None,
    log: Path | None = None,
    **settings: str,
):
    """The launcher of node ``rank``; its output in a pipe, or appended to ``log`` for a run nobody reads while it
    goes on (a pipe would fill and stop it)."""
    command = [str(node / "scripts" / "run_ddp_train.sh"), gpus, str(rank), *extra]
    if netns:
        command = ["ip", "netns", "exec", netns, *command]
    env = launcher_env(**settings)
    if log is not None:
        with log.open("a") as output:
            return subprocess.Popen(command, env=env, stdout=output, stderr=output)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout: float = 600) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output
    return output


def probe_args(out_dir: Path) -> list[str]:
    return ["--trainer.callbacks+=tests.helpers.probe.RankProbe", f"--trainer.callbacks.out_dir={out_dir}"]


def run_job(
    workdir: Path, *args: str, probe_options: tuple[str, ...] = (), world_size: int = 2
) -> tuple[str, list[dict]]:
    """Run ``python cli.py ARGS`` in ``workdir`` as a real job with tests.helpers.probe.RankProbe (``probe_options`` are
    its arguments); return the job's output and what each rank recorded."""
    probe = [*probe_args(workdir / "probe"), *probe_options]
    result = run_script([str(REPO / "cli.py"), *args, *probe], cwd=workdir)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output, probe_records(workdir / "probe", world_size)


def probe_records(probe_dir: Path, world_size: int) -> list[dict]:
    """What tests.helpers.probe.RankProbe saved for each rank, in rank order."""
    return [torch.load(probe_dir / f"rank{rank}.pt") for rank in range(world_size)]


def check_ranks(probe_dir: Path, nodes: int = 2, per_node: int = 2) -> list[dict]:
    """World size ``nodes * per_node`` on gloo, disjoint shards covering the data, identical parameters."""
    world_size = nodes * per_node
    records = probe_records(probe_dir, world_size)
    assert [(r["global_rank"], r["world_size"], r["backend"]) for r in records] == [
        (i, world_size, "gloo") for i in range(world_size)
    ]
    assert sorted((r["node_rank"], r["local_rank"]) for r in records) == [
        (node, local) for node in range(nodes) for local in range(per_node)
    ]

    data = RandomDataModule()
    data.setup("fit")
    index_of = {row.numpy().tobytes(): i for i, row in enumerate(data.splits["train"].tensors[0])}
    shards = [{index_of[row.numpy().tobytes()] for row in r["inputs"]} for r in records]
    assert sum(len(s) for s in shards) == len(index_of) and set().union(*shards) == set(index_of.values())

    for record in records[1:]:
        for name, value in records[0]["params"].items():
            assert torch.equal(value, record["params"][name]), name
    return records


def write_pairs(path: Path, count: int, seed: int = 0) -> Path:
    """A seq2seq TSV file of reversed letters (another task than the built-in one), repeats and mixed lengths."""
    rng = random.Random(seed)
    sources = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 14))) for _ in range(count)]
    path.write_text("".join(f"{s}\t{s[::-1]}\n" for s in sources), encoding="utf-8")
    return path


def written_files(node: Path) -> list[str]:
    return sorted(p.relative_to(node).as_posix() for p in (node / "logs").rglob("*") if p.is_file())


def processes_in(directory: Path) -> list[int]:
    """Processes whose working directory is inside ``directory``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")).is_relative_to(directory):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def torchrun_workers(node: Path) -> list[int]:
    """The training processes torchrun started for the launch in ``node`` (not torchrun itself)."""
    commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in processes_in(node)}
    return [pid for pid, line in commands.items() if b"cli.py" in line and b"torch.distributed.run" not in line]


def wait_for_step(progress: Path, step: int, timeout: float = 300) -> None:
    """Wait until the file tests.helpers.probe.SlowDown writes shows at least ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        written = progress.read_text() if progress.exists() else ""
        if written.isdigit() and int(written) >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"{progress} never reached step {step}")


def wait_for_hold(hold_file: Path, world_size: int, process: subprocess.Popen, timeout: float = 600) -> None:
    """Wait until every rank holds at the step of tests.helpers.probe.HoldAtStep; fail with the output if the run
    ended."""
    markers = [Path(f"{hold_file}.rank{rank}") for rank in range(world_size)]
    deadline = time.monotonic() + timeout
    while not all(marker.exists() for marker in markers):
        if process.poll() is not None:
            raise AssertionError(f"the run ended before holding at its step:\n{process.communicate()[0]}")
        assert time.monotonic() < deadline, f"no rank held at {hold_file} within {timeout} s"
        time.sleep(0.05)


def assert_everything_stopped(node: Path, port: str) -> None:
    """No process of the launch in ``node`` runs any more, and nobody listens on its port."""
    deadline = time.monotonic() + 60
    while processes_in(node) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_in(node) == [], "training processes were left running"
    with socket.socket() as listener:  # nobody listens on the port any more (as TCPStore, allow TIME_WAIT)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(port)))
        listener.listen()


def serve(
    command: list[str], port: int, log: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start a server on 127.0.0.1:``port`` (its output in ``log``, ``env`` added to its environment) and wait until
    it accepts connections. It runs outside the test's directories, so a test's clean-up of training processes leaves
    it up, and outlives any job the test kills."""
    environment = {**os.environ, **(env or {})}
    server = subprocess.Popen(
        command, cwd="/", env=environment, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise AssertionError(f"{command[0]} did not start on port {port}:\n{log.read_text()}") from None
            time.sleep(0.2)


def cli_job(workdir: Path, run_id: str, *args: str) -> subprocess.CompletedProcess:
    """``python cli.py ARGS`` in ``workdir`` as the run ``run_id``, as a user runs it; its status is the caller's to
    check."""
    return run_script([str(REPO / "cli.py"), *args], cwd=workdir, env={"RUN_ID": run_id})


def job_output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def succeeded(result: subprocess.CompletedProcess) -> str:
    """The output of a job that must have succeeded."""
    assert result.returncode == 0, job_output(result)
    return job_output(result)


def plain_lightning_cli(*args: str):
    """Plain LightningCLI, as the user would run the module without the template: one process on the CPU, no logger,
    nothing run yet (``cli.trainer`` and ``cli.model`` are there to call)."""
    from lightning.pytorch.cli import LightningCLI

    plain = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false"]
    return LightningCLI(
        args=[*args, *plain, "--trainer.enable_progress_bar=false"], run=False, save_config_callback=None
    )


def plain_predictions(checkpoint: Path, *args: str) -> torch.Tensor:
    """What plain LightningCLI predicts for the model and data ``args`` choose, with ``checkpoint``'s weights."""
    cli = plain_lightning_cli(*args)
    return torch.cat(cli.trainer.predict(cli.model, datamodule=cli.datamodule, ckpt_path=str(checkpoint)))


def stopped_in_the_run(run_cli, capsys, *args: str) -> str:
    """The last line of a one-process fit of configs/ddp.yaml that stops once running: exit 1, no traceback."""
    with pytest.raises(SystemExit) as exit_:
        run_cli("fit", "-c", DDP_YAML, *SINGLE_PROCESS, *args)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@contextlib.contextmanager
def tmpfs(disk: Path, size: str) -> Iterator[Path]:
    """A file system of ``size`` (tmpfs, e.g. "300k") mounted on the new directory ``disk``, unmounted after; the test
    is skipped where mounting needs a root this user is not."""
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def fill(disk: Path) -> None:
    """Write into ``disk`` until it is full."""
    with contextlib.suppress(OSError), (disk / "filler").open("wb", buffering=0) as filler:
        while True:
            filler.write(b"x" * 4096)
