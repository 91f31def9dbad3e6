"""What processes of one job must agree on, in a form cheap to send and easy to compare."""

import functools
import hashlib
import os
import site
import sys
import sysconfig
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem

# Where Python and the installed packages live; their versions are compared on their own (torch, Lightning).
INSTALLED = tuple(
    str(Path(p).resolve())
    for p in {
        *(sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")),
        *site.getsitepackages(),
        site.getusersitepackages(),
    }
)


def imported_code() -> dict[str, Path]:
    """The source file of every module this process imported from outside the Python installation, by module
    name: the project's own modules and any user package a ``class_path`` named, wherever it lives."""
    code = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None) or ""
        # Some "modules" are namespaces that torch builds, with a file name but no file.
        if (
            file.endswith(".py")
            and os.path.isabs(file)
            and os.path.isfile(file)
            and not real_path(file).startswith(INSTALLED)
        ):
            code[name] = Path(file)
    return code


def real_path(file: str) -> str:
    """``os.path.realpath(file)``, each directory resolved once: a training process imports some 2,800 modules from
    a few hundred directories, and resolving each file's whole path took 0.1 s of CPU."""
    directory, name = os.path.split(file)
    return os.path.realpath(file) if os.path.islink(file) else os.path.join(real_directory(directory), name)


@functools.cache
def real_directory(directory: str) -> str:
    return os.path.realpath(directory)


def code_digest() -> str:
    """A short hash of ``imported_code``, by module name and content (each node may keep its clone elsewhere)."""
    digest = hashlib.sha256()
    for name, path in sorted(imported_code().items()):
        digest.update(name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def config_items(config: dict[str, Any]) -> dict[str, str]:
    """A resolved config (a subcommand's, as a dict) as ``{"trainer.max_epochs": "5", ...}``.

    Left out: the paths of the config files (each node may keep its clone elsewhere), and the node count and
    devices per node, which the handshake compares on their own.
    """
    items: dict[str, str] = {}

    def flatten(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for name, inner in value.items():
                flatten(inner, f"{key}.{name}" if key else str(name))
        elif isinstance(value, list):
            for index, inner in enumerate(value):
                flatten(inner, f"{key}.{index}")
        else:
            items[key] = str(value)

    flatten({k: v for k, v in config.items() if k != "config"}, "")
    for key in ("trainer.num_nodes", "trainer.devices"):
        items.pop(key, None)
    return items


def items_digest(items: dict[str, str]) -> str:
    """A short hash of ``config_items``, for a table cell."""
    return hashlib.sha256(repr(sorted(items.items())).encode()).hexdigest()[:12]


def checkpoint_fact(path: str | None) -> str:
    """The checkpoint a process loads (a local path or an object store URL), with its size, so nodes reading
    different files show up."""
    if path is None:
        return "none"
    fs = get_filesystem(path)
    return f"{path} ({fs.du(path) if fs.isdir(path) else fs.size(path)} bytes)"
