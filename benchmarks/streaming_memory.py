"""Peak memory per process of the seq2seq example: a pairs file held in memory against its shard directory.

    python -m benchmarks.streaming_memory [--pairs 40000 800000] [--steps 100] [--workdir DIR]

For each size, writes a file of that many pairs (letters to be reversed, 3 to 35 of them, so as long as the
built-in corpus's pairs), converts it with scripts/make_shards.py, and trains the config's model with
2 CPU processes for ``--steps`` steps and 5 validation batches, once from the file and once from the shards.
Prints each rank's peak resident memory (``ru_maxrss``: the process's own pages, torch included).
"""

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

REPO = Path(__file__).resolve().parents[1]


class PeakMemory(Callback):
    """Writes ``rank<N>.json`` in ``out_dir`` at the end of training: the process's peak RSS in MiB."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps({"peak_mib": peak}))


def write_pairs(path: Path, count: int) -> None:
    rng = random.Random(count)
    with open(path, "w", encoding="utf-8") as file:
        for _ in range(count):
            source = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 35)))
            file.write(f"{source}\t{source[::-1]}\n")


def peak_per_rank(workdir: Path, data_path: Path, steps: int, name: str) -> list[float]:
    out = workdir / f"peak-{name}"
    configs = ["-c", str(REPO / "configs" / "ddp.yaml"), "-c", str(REPO / "configs" / "seq2seq.yaml")]
    command = [sys.executable, str(REPO / "cli.py"), "fit", *configs, "--trainer.accelerator=cpu"]
    command += ["--trainer.devices=2", "--trainer.max_epochs=1", f"--trainer.limit_train_batches={steps}"]
    command += ["--trainer.limit_val_batches=5", f"--data.init_args.path={data_path}"]
    command += ["--trainer.callbacks+=benchmarks.streaming_memory.PeakMemory", f"--trainer.callbacks.out_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RUN_ID": name}  # a run id each: none resumes another
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"the run on {data_path} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return [json.loads((out / f"rank{rank}.json").read_text())["peak_mib"] for rank in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, nargs="+", default=[40000, 800000])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workdir", type=Path, help="where the files go (default: a temporary directory)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="streaming-memory-"))
    workdir.mkdir(parents=True, exist_ok=True)
    header = f"{'pairs':>9}  {'file MiB':>8}  {'convert s':>9}  {'in memory, MiB per rank':>23}"
    print(f"{header}  {'shards, MiB per rank':>20}")
    for count in args.pairs:
        pairs, shards = workdir / f"pairs{count}.tsv", workdir / f"shards{count}"
        print(f"writing {pairs} and converting it ...", file=sys.stderr, flush=True)
        write_pairs(pairs, count)
        start = time.perf_counter()
        converted = subprocess.run([sys.executable, str(REPO / "scripts" / "make_shards.py"), str(pairs), str(shards)])
        if converted.returncode != 0:
            sys.exit(f"make_shards.py failed on {pairs}")
        seconds = time.perf_counter() - start
        print(f"training {args.steps} steps from each ...", file=sys.stderr, flush=True)
        in_memory = peak_per_rank(workdir, pairs, args.steps, f"file{count}")
        streamed = peak_per_rank(workdir, shards, args.steps, f"shards{count}")
        size = pairs.stat().st_size / 2**20
        row = f"{count:>9,}  {size:>8.1f}  {seconds:>9.1f}  {' / '.join(f'{m:.0f}' for m in in_memory):>23}"
        print(f"{row}  {' / '.join(f'{m:.0f}' for m in streamed):>20}", flush=True)


if __name__ == "__main__":
    main()
