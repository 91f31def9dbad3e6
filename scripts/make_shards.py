"""Convert a seq2seq pairs file into a shard directory that the seq2seq DataModule streams.

    python scripts/make_shards.py pairs.tsv shards/
    python cli.py fit -c configs/ddp.yaml -c configs/seq2seq.yaml --data.init_args.path=shards/

INPUT is a file ``data.path`` accepts (``.tsv``/``.txt``: ``source<TAB>target``; ``.jsonl``), checked line by
line with the same messages. The validation split is made here, as the DataModule makes it from a file:
``--val-fraction`` of the distinct sources, drawn with ``--seed`` (``data.val_fraction`` and ``data.seed`` of
the run must match; the defaults match configs/seq2seq.yaml). Training pairs are shuffled once, so every
shard is a sample of the whole file. The conversion holds the file's pairs in memory once; training then
holds one shard per process.
"""

import argparse
import sys
import time
from pathlib import Path

# Run as a file (python scripts/make_shards.py), its folder, not the project, is on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from data.pairs_file import iter_pairs, split_pairs  # noqa: E402
from data.shards import INDEX, write_shards  # noqa: E402


class Progress:
    """One line on stderr, rewritten in place on a terminal, every ``every`` seconds at most elsewhere."""

    def __init__(self, every: float = 5.0) -> None:
        self.tty = sys.stderr.isatty()
        self.every = every if not self.tty else 0.2
        self.last = time.monotonic()

    def show(self, text: str, final: bool = False) -> None:
        now = time.monotonic()
        if final or now - self.last >= self.every:
            self.last = now
            end = "\n" if final or not self.tty else ""
            print(f"\r{text}" if self.tty else text, end=end, file=sys.stderr, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", metavar="INPUT", type=Path, help="a .tsv, .txt or .jsonl file of pairs")
    parser.add_argument("output", metavar="OUTPUT_DIR", type=Path, help="a new directory for the shards")
    parser.add_argument("--shard-size", type=int, default=10000, help="pairs per shard (default 10000)")
    parser.add_argument("--val-fraction", type=float, default=0.025, help="held-out sources (default 0.025)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and the shuffle (default 0)")
    args = parser.parse_args(argv)
    if args.shard_size < 1:
        parser.error(f"--shard-size must be a positive integer, got {args.shard_size}")
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction must be between 0 and 1, got {args.val_fraction}")
    if args.output.exists():
        parser.error(f"{args.output} already exists; give a new directory (an old conversion is never overwritten)")
    return args


def convert(args: argparse.Namespace) -> dict[str, int]:
    progress = Progress()
    pairs = []
    for pairs_read, pair in enumerate(iter_pairs(args.input, "INPUT"), start=1):
        pairs.append(pair)
        progress.show(f"checked {pairs_read:,} pairs of {args.input}")
    progress.show(f"checked {len(pairs):,} pairs of {args.input}", final=True)
    train, val = split_pairs(pairs, args.val_fraction, args.seed, "--val-fraction")
    del pairs
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed)).tolist()
    splits = {"train": [train[i] for i in order], "val": sorted(val, key=lambda pair: (len(pair[1]), len(pair[0])))}
    settings = {
        "input": args.input.name,
        "val_fraction": args.val_fraction,
        "seed": args.seed,
        "alphabet": sorted({c for pairs in splits.values() for pair in pairs for text in pair for c in text}),
    }

    def shown(done: int, total: int) -> None:
        progress.show(f"wrote {done} of {total} shards to {args.output}", final=done == total)

    write_shards(splits, args.output, args.shard_size, settings, shown)
    return {split: len(pairs) for split, pairs in splits.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        counts = convert(args)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"{args.output}: {counts['train']:,} training and {counts['val']:,} validation pairs, index in "
        f"{args.output / INDEX}. Train on it with --data.init_args.path={args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
