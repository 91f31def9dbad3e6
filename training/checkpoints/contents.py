"""What a checkpoint file on the local disk holds: its two counters, or what keeps it from being a checkpoint, said
in plain words with the file's size (torch's own errors speak of mmap, miniz and zipfile serialization)."""

import os
import pickle
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from training.run.storage import shown

ZIP_START = b"PK\x03\x04"  # torch.save writes a zip archive: its first four bytes
# torch.load(weights_only=True)'s own sentence on an object it does not unpickle (among lines with terminal escapes).
REFUSED = re.compile(r"WeightsUnpickler error: (Unsupported global: GLOBAL ([\w.]+)[^\n]*)")


def counters(path: str | Path, weights_only: bool = True) -> tuple[int, int]:
    """(epochs begun, optimizer steps done) of the checkpoint file ``path``; ValueError when it is no checkpoint."""
    if problem := damage(path):
        raise ValueError(problem)
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        # The epoch a checkpoint saved at the end of training holds is the next one, never begun (a run without
        # validation saves its last.ckpt there): the loop's count of epochs started is right wherever it was saved.
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
        return progress.get("started", checkpoint["epoch"] + 1), checkpoint["global_step"]
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError, KeyError, TypeError) as error:
        if refused := REFUSED.search(str(error)):
            raise ValueError(unsafe_object(path, refused[2], refused[1])) from None
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"{described(path)} cannot be read as a Lightning checkpoint ({reason}). {advice(path)}"
        ) from None


def unsafe_object(path: str | Path, name: str, cause: str) -> str:
    """The paragraph for a checkpoint holding an object of type ``name`` that torch.load(weights_only=True) refuses
    (``cause``, torch's words). Every checkpoint the same module saved holds one: none is offered instead."""
    return (
        f"{described(path)} holds an object of type {name}, which the run cannot load the way it loads checkpoints, "
        f"torch.load(weights_only=True) (the config's weights_only; torch: {cause.strip()}). Nothing was "
        "changed. Store tensors and plain types in the checkpoint instead (torch.from_numpy for an array, in the "
        "module's on_save_checkpoint, and back in on_load_checkpoint); or, for a file you trust, allow the type: "
        f"torch.serialization.add_safe_globals([{name}]) where the module is defined, or --weights_only=false, which "
        "unpickles whatever the file holds."
    )


def unloadable(checkpoint: dict[str, Any], path: Path) -> str | None:
    """The paragraph for ``checkpoint``, just written to ``path``, where torch.load(weights_only=True) refuses an
    object in it, as the run's resume will; None where it loads. Tensors stay in the file (mmap): only its structure
    is read."""
    try:
        torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return None
    except pickle.UnpicklingError as error:
        refused = REFUSED.search(str(error))
    except (OSError, RuntimeError):  # a file system without mmap, say: the check says nothing, a resume reads it anyway
        return None
    if refused is None:
        return None
    where, value = held_object(checkpoint, refused[2])
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return (
        f"the checkpoint just saved, {shown(path)}, holds an object of type {kind} under {where} (pickled as "
        f"{refused[2]}), which the run cannot load back the way it loads checkpoints, torch.load(weights_only=True) "
        "(the config's weights_only): resuming this run, a requeue after preemption, and validate, test or predict "
        "from its checkpoints would stop there. Store tensors and plain types in the checkpoint instead "
        "(torch.from_numpy for an array, in the module's on_save_checkpoint, and back in on_load_checkpoint); or, for "
        "files you trust, allow the type with torch.serialization.add_safe_globals where the module is defined, or "
        "set weights_only: false, which unpickles whatever a file holds."
    )


def held_object(checkpoint: dict[str, Any], name: str) -> tuple[str, Any]:
    """Where in ``checkpoint`` an object pickled through ``name`` (a global of its package) is, and the object: the
    first value that is neither a tensor, a plain type nor a container of them, of that package if one is."""
    found = list(odd_values(checkpoint, "checkpoint"))
    package = name.split(".")[0]
    return next((item for item in found if type(item[1]).__module__.split(".")[0] == package), found[0])


# What a checkpoint holds besides containers, that torch.load(weights_only=True) takes.
PLAIN = (torch.Tensor, torch.Size, torch.dtype, torch.device, str, bytes, int, float)


def odd_values(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Every value in ``value`` (at ``where``) that is neither a plain container, a tensor nor a plain type."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from odd_values(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple | set) and type(value) in (list, tuple, set):
        for index, item in enumerate(value):
            yield from odd_values(item, f"{where}[{index}]")
    elif value is not None and not isinstance(value, PLAIN):
        yield where, value


def damage(path: str | Path) -> str | None:
    """The paragraph for a file that cannot be a whole torch checkpoint (empty, cut short, no zip archive), or None."""
    with open(path, "rb") as file:
        start = file.read(len(ZIP_START))
    if not start:
        what = "is empty: a save or a copy that wrote nothing (a full disk, or a copy that never started)"
    elif start != ZIP_START:
        kind = "a text file" if is_text(path) else "some other file"
        what = f"is not a checkpoint: a torch checkpoint is a zip archive, and this is {kind}"
    elif not zipfile.is_zipfile(path):
        what = (
            "is not a complete checkpoint: a torch checkpoint is a zip archive, and this one is cut short (a copy "
            "interrupted, or a disk that filled up while another tool wrote it)"
        )
    else:
        return None
    return f"{described(path)} {what}. {advice(path)}"


def described(path: str | Path) -> str:
    return f"{shown(path)} ({size_text(os.path.getsize(path))})"


def advice(path: str | Path) -> str:
    """How to go on without the file ``path``, which stays where it is."""
    others = [other for other in Path(path).parent.glob("*.ckpt") if other.name != Path(path).name and whole(other)]
    newest = f", such as {shown(max(others, key=os.path.getmtime))}, the newest beside it" if others else ""
    fresh = " or move it away to start the run over: cli.py fit then begins at its first step" if is_last(path) else ""
    return f"Nothing was changed. Give another checkpoint with --ckpt_path{newest};{fresh}".rstrip(";") + "."


def is_last(path: str | Path) -> bool:
    """Whether ``path`` is a run's last.ckpt (or last-N.ckpt), which ``ckpt_path: last`` finds by itself."""
    return Path(path).name.startswith("last")


def whole(path: Path) -> bool:
    """Whether ``path`` looks like a complete checkpoint: a zip archive with its directory at the end."""
    try:
        with open(path, "rb") as file:
            return file.read(len(ZIP_START)) == ZIP_START and zipfile.is_zipfile(file)
    except OSError:
        return False


def is_text(path: str | Path) -> bool:
    with open(path, "rb") as file:
        start = file.read(4096)
    try:
        start.decode()
    except UnicodeDecodeError:
        return False
    return b"\0" not in start


def size_text(size: float) -> str:
    """``size`` bytes as a person reads it: 0 bytes, 312 KB, 1.5 GB."""
    if size < 1024:
        return f"{size:.0f} bytes"
    for unit in ("KB", "MB", "GB", "TB"):
        size /= 1024
        if size < 1024 or unit == "TB":
            break
    return f"{size:.0f} {unit}" if size >= 10 else f"{size:.1f} {unit}"
