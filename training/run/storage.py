"""Where a run's files live: a local directory or an object store URL (``s3://bucket/logs``), through fsspec.

A URL must stay a string: ``pathlib.Path("s3://bucket/x")`` is ``s3:/bucket/x``, a local path.
"""

from pathlib import Path
from typing import Any

import fsspec
from fsspec.utils import get_protocol

from training.config.trainer_settings import entries

# The package and the requirements file of each object store's fsspec client the template is tested with.
CLIENTS = {"s3": ("s3fs", "requirements-s3.txt")}


def is_remote(path: Any) -> bool:
    """Whether ``path`` is a URL of another filesystem than the local one (``s3://...``)."""
    return path is not None and get_protocol(str(path)) not in ("file", "local")


def shown(path: Any) -> str:
    """``path`` as a message shows it: a local path made absolute, a URL as given."""
    return str(path) if is_remote(path) else str(Path(path).resolve())


def parent(path: str) -> str:
    """The directory of ``path``, a local path or a URL."""
    return path.rstrip("/").rsplit("/", 1)[0] if is_remote(path) else str(Path(path).parent)


def storage_problem(settings: dict[str, Any]) -> str | None:
    """What keeps the URLs of ``settings`` (a subcommand's config, as a dict) from being read or written, or None:
    an object store whose fsspec client is not installed, or a protocol fsspec does not know."""
    trainer = settings.get("trainer") or {}
    places = [("--ckpt_path", settings.get("ckpt_path")), ("trainer.default_root_dir", trainer.get("default_root_dir"))]
    for logger in entries(trainer.get("logger")):
        places.append(("the logger's save_dir", (logger.get("init_args") or {}).get("save_dir")))
    for key, value in places:
        if not isinstance(value, str) or not is_remote(value):
            continue
        protocol = get_protocol(value)
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError:
            package, requirements = CLIENTS.get(protocol, (f"the fsspec client of {protocol}://", ""))
            install = f"pip install -r {requirements}" if requirements else f"install {package}"
            return (
                f"{key} is {value}: reading and writing {protocol}:// URLs needs {package}, which is not installed. "
                f"Install it ({install}), or give a local path."
            )
        except ValueError:
            return f"{key} is {value}: fsspec knows no {protocol}:// filesystem. Give a local path or an s3:// URL."
    return None
