"""A directory of seq2seq shards, written once by ``scripts/make_shards.py`` and read a shard at a time.

The directory holds ``index.json`` (the vocabulary's characters, the split's settings and the size of every
shard) and the shards, ``train-00000.tsv``... and ``val-00000.tsv``..., checked ``source<TAB>target`` lines.
Training pairs are shuffled once when written, so reading a shard gives a sample of the whole file;
validation pairs are sorted by length, so a batch's greedy decoding stops early.
"""

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

FORMAT = "seq2seq-shards/1"
INDEX = "index.json"
SPLITS = ("train", "val")


def write_shards(
    splits: dict[str, list[tuple[str, str]]],
    directory: Path,
    shard_size: int,
    settings: dict,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> None:
    """Write ``splits`` as shards of ``shard_size`` pairs into ``directory``, which must not exist yet.

    Everything is written to a temporary directory beside it, renamed into place at the end: an interrupted
    conversion leaves no directory that looks complete.
    """
    partial = directory.with_name(f".{directory.name}.{uuid.uuid4().hex}.partial")
    partial.mkdir(parents=True)
    try:
        total = sum(-(-len(pairs) // shard_size) for pairs in splits.values())
        sizes: dict[str, list[int]] = {}
        for split, pairs in splits.items():
            sizes[split] = []
            for start in range(0, len(pairs), shard_size):
                chunk = pairs[start : start + shard_size]
                name = shard_name(split, len(sizes[split]))
                (partial / name).write_text("".join(f"{s}\t{t}\n" for s, t in chunk), encoding="utf-8")
                sizes[split].append(len(chunk))
                progress(sum(map(len, sizes.values())), total)
        index = {"format": FORMAT, **settings, **sizes}
        (partial / INDEX).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
        os.rename(partial, directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:05d}.tsv"


def read_index(directory: Path, flag: str = "data.path") -> dict:
    """``index.json`` of a shard directory, with every shard it names checked to be there."""
    remedy = f"convert your file with: python scripts/make_shards.py FILE {directory}"
    try:
        index = json.loads((directory / INDEX).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{flag}: {directory} is a directory without {INDEX}; {remedy}") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"{flag}: {directory / INDEX} cannot be read ({error}); {remedy}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{flag}: {directory / INDEX} is not a {FORMAT} index; {remedy}")
    for split in SPLITS:
        for number, size in enumerate(index[split]):
            shard = directory / shard_name(split, number)
            if not shard.is_file():
                raise ValueError(f"{flag}: {shard} is missing ({size} pairs); {remedy}")
    return index


class ShardReader:
    """The pairs of one split by position, holding one shard in memory at a time."""

    def __init__(self, directory: str | Path, split: str, sizes: Iterable[int]) -> None:
        self.directory = Path(directory)
        self.split = split
        self.sizes = list(sizes)
        self.loaded: tuple[int, list[tuple[str, str]]] | None = None

    def __len__(self) -> int:
        return sum(self.sizes)

    def shard(self, number: int) -> list[tuple[str, str]]:
        if self.loaded is None or self.loaded[0] != number:
            text = (self.directory / shard_name(self.split, number)).read_text(encoding="utf-8")
            pairs = [tuple(line.split("\t")) for line in text.splitlines()]
            if len(pairs) != self.sizes[number]:
                raise ValueError(
                    f"{self.directory / shard_name(self.split, number)} has {len(pairs)} pairs, its index says "
                    f"{self.sizes[number]}: the shard directory was changed after it was written; convert again"
                )
            self.loaded = number, pairs
        return self.loaded[1]
