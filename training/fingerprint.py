"""What processes of one job must agree on, in a form cheap to send and easy to compare."""

import hashlib
from pathlib import Path
from typing import Any

PROJECT = Path(__file__).resolve().parents[1]
CODE = ["cli.py", "models/**/*.py", "data/**/*.py", "training/**/*.py"]


def code_digest(root: Path = PROJECT) -> str:
    """A short hash of the project's Python code, by path and content."""
    digest = hashlib.sha256()
    for path in sorted({p for pattern in CODE for p in root.glob(pattern)}):
        digest.update(path.relative_to(root).as_posix().encode())
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
    """The checkpoint a process loads, with its size, so nodes reading different files show up."""
    if path is None:
        return "none"
    files = [Path(path)] if Path(path).is_file() else [p for p in Path(path).rglob("*") if p.is_file()]
    return f"{path} ({sum(file.stat().st_size for file in files)} bytes)"
