"""Helpers for tests that start the launcher as the nodes of a cluster."""

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from data import RandomDataModule


def launcher_env(**settings: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MASTER_", "NUM_NODES"))}
    return {**env, "PYTHON": sys.executable, **settings}


def launch(node: Path, gpus: str, rank: int | str, *extra: str, netns: str | None = None, **settings: str):
    command = [str(node / "scripts" / "run_ddp_train.sh"), gpus, str(rank), *extra]
    if netns:
        command = ["ip", "netns", "exec", netns, *command]
    return subprocess.Popen(
        command, env=launcher_env(**settings), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(process: subprocess.Popen, timeout: float = 600) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output
    return output


def probe_args(out_dir: Path) -> list[str]:
    return ["--trainer.callbacks+=tests.probe.RankProbe", f"--trainer.callbacks.out_dir={out_dir}"]


def probe_records(probe_dir: Path, world_size: int) -> list[dict]:
    """What tests.probe.RankProbe saved for each rank, in rank order."""
    return [torch.load(probe_dir / f"rank{rank}.pt") for rank in range(world_size)]


def check_four_ranks(probe_dir: Path) -> list[dict]:
    """World size 4, two ranks per node, disjoint shards covering the data, identical parameters."""
    records = probe_records(probe_dir, 4)
    assert [(r["global_rank"], r["world_size"], r["backend"]) for r in records] == [(i, 4, "gloo") for i in range(4)]
    assert sorted((r["node_rank"], r["local_rank"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]

    data = RandomDataModule()
    data.setup("fit")
    index_of = {row.numpy().tobytes(): i for i, row in enumerate(data.splits["train"].tensors[0])}
    shards = [{index_of[row.numpy().tobytes()] for row in r["inputs"]} for r in records]
    assert sum(len(s) for s in shards) == len(index_of) and set().union(*shards) == set(index_of.values())

    for record in records[1:]:
        for name, value in records[0]["params"].items():
            assert torch.equal(value, record["params"][name]), name
    return records


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


def wait_for_step(progress: Path, step: int, timeout: float = 300) -> None:
    """Wait until the file tests.probe.SlowDown writes shows at least ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        written = progress.read_text() if progress.exists() else ""
        if written.isdigit() and int(written) >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"{progress} never reached step {step}")
