"""Reading and checking the seq2seq example's text files: pairs (``data.path``, the built-in corpus) and sources
(``data.predict_path``).

The first bad line raises a ValueError naming the flag, the file, the line number, the problem and the expected format.
"""

import json
from collections.abc import Collection, Iterator
from pathlib import Path

import torch


def _lines(path: Path, flag: str) -> Iterator[tuple[int, str]]:
    """Yield ``(line_number, text)`` of a UTF-8 file, with the failing line named if it is not UTF-8."""
    if not path.is_file():
        raise ValueError(f"{flag}: no such file: {path}")
    raw = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a BOM left by some Windows editors
    if not raw.strip():
        raise ValueError(f"{flag}: {path} is empty")
    for number, line in enumerate(raw.removesuffix(b"\n").split(b"\n"), start=1):
        try:
            yield number, line.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{flag}: {path}:{number}: not valid UTF-8 ({error.reason}); save the file as UTF-8"
            ) from None


def _check_text(text: str, what: str) -> str | None:
    if not text:
        return f"empty {what}"
    if "\t" in text or "\n" in text:
        return f"the {what} contains a tab or line break, which a source<TAB>prediction line could not hold"
    return None


def read_pairs(path: str | Path, flag: str = "data.path") -> list[tuple[str, str]]:
    """Parse ``source<TAB>target`` lines (``.tsv``, ``.txt``) or ``{"source": ..., "target": ...}`` lines (``.jsonl``).

    The whole file is checked before anything uses it; the first bad line raises a ValueError naming
    ``flag``, the file, the line number, the problem and the expected format.
    """
    return list(iter_pairs(path, flag))


def iter_pairs(path: str | Path, flag: str = "data.path") -> Iterator[tuple[str, str]]:
    """The pairs of :func:`read_pairs` one by one, each checked before it is yielded."""
    path = Path(path)
    if path.suffix not in (".tsv", ".txt", ".jsonl"):
        raise ValueError(f"{flag}: {path}: unknown format; name the file .tsv (source<TAB>target) or .jsonl")
    jsonl = path.suffix == ".jsonl"
    expected = '{"source": "...", "target": "..."}' if jsonl else "source<TAB>target"
    for number, line in _lines(path, flag):
        if jsonl:
            pair, problem = _parse_json_line(line)
        else:
            pair, problem = _parse_tsv_line(line)
        problem = problem or _check_text(pair[0], "source") or _check_text(pair[1], "target")
        if problem:
            raise ValueError(f"{flag}: {path}:{number}: {problem}; each line must be {expected}")
        yield pair


def num_val(sources: Collection[str], val_fraction: float, flag: str = "data.val_fraction") -> int:
    """How many distinct sources to hold out for validation; at least one, and at least one left to train on."""
    count = max(1, round(len(sources) * val_fraction))
    if count >= len(sources):
        raise ValueError(
            f"{flag}={val_fraction} of {len(sources)} distinct sources leaves "
            f"{len(sources) - count} to train on; lower {flag} or add data"
        )
    return count


def too_few_sources(count: int, where: str, more: str, val_fraction: float, processes: int) -> str | None:
    """The paragraph when ``count`` distinct sources (``where`` names them) split by ``val_fraction`` cannot give
    each of ``processes`` processes a source to validate and one to train on, or None. ``more`` says how to give
    more sources: a format string of the number needed.

    Lightning's sampler that shares the validation set out without repeats refuses a process with nothing to
    validate, with a bare AssertionError from that process.
    """

    def held_out(sources: int) -> int:
        return max(1, round(sources * val_fraction))

    if held_out(count) >= processes and count - held_out(count) >= processes:
        return None
    needed = next(n for n in range(2 * processes, 2**31) if min(held_out(n), n - held_out(n)) >= processes)
    other_fraction = f", raise data.val_fraction to {processes / count:.3g}" if count >= 2 * processes else ""
    return (
        f"{where} holds {count} distinct source{'s' if count != 1 else ''}: data.val_fraction={val_fraction} holds "
        f"out {held_out(count)} for validation and leaves {count - held_out(count)} to train on, and each of the "
        f"{processes} processes needs at least one of each. {more.format(needed)}{other_fraction}, or start fewer "
        "processes (trainer.devices, trainer.num_nodes)."
    )


def split_pairs(
    pairs: list[tuple[str, str]], val_fraction: float, seed: int, flag: str = "data.val_fraction"
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(train, val)``: ``val_fraction`` of the distinct sources, drawn with ``seed``, held out with a target each.

    Split by source, so no validation source was trained on; each keeps its first target, scored once.
    """
    first_target = dict(reversed(pairs))  # each source's first target in the file
    sources = list(dict.fromkeys(source for source, _ in pairs))
    order = torch.randperm(len(sources), generator=torch.Generator().manual_seed(seed)).tolist()
    # A list, not a set: every rank must see the validation pairs in the same order to shard them.
    held_out = [sources[i] for i in order[: num_val(sources, val_fraction, flag)]]
    held_out_set = set(held_out)
    val = [(source, first_target[source]) for source in held_out]
    return [pair for pair in pairs if pair[0] not in held_out_set], val


def _parse_tsv_line(line: str) -> tuple[tuple[str, str], str | None]:
    if not line:
        return ("", ""), "empty line"
    fields = line.split("\t")
    if len(fields) != 2:
        return ("", ""), "no tab" if len(fields) == 1 else f"{len(fields) - 1} tabs, expected one"
    return (fields[0], fields[1]), None


def _parse_json_line(line: str) -> tuple[tuple[str, str], str | None]:
    try:
        record = json.loads(line) if line else None
    except json.JSONDecodeError as error:
        return ("", ""), f"not valid JSON ({error.msg} at column {error.colno})"
    if not isinstance(record, dict):
        return ("", ""), "empty line" if not line else "not a JSON object"
    unknown = sorted(set(record) - {"source", "target"})
    if unknown:
        return ("", ""), f"unknown field {unknown[0]!r}"
    missing = [key for key in ("source", "target") if key not in record]
    if missing:
        return ("", ""), f"missing field {missing[0]!r}"
    if not all(isinstance(record[key], str) for key in ("source", "target")):
        return ("", ""), "source and target must be strings"
    return (record["source"], record["target"]), None


def read_sources(path: str | Path, flag: str = "data.predict_path") -> list[str]:
    """One source per line, checked like :func:`read_pairs`."""
    sources = []
    for number, line in _lines(Path(path), flag):
        problem = _check_text(line, "source")
        if problem:
            raise ValueError(f"{flag}: {path}:{number}: {problem}; give one source per line")
        sources.append(line)
    return sources
