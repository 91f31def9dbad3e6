"""Whether this process can create and write in the run's local directories, checked before anything starts: a
directory it may not write in (a read-only mount, another user's ``logs``) or a file where a directory should be
would otherwise stop the first process that writes there with a traceback, after every process started."""

import os
from pathlib import Path
from typing import Any

from training.config.trainer_settings import entries
from training.run.record import logger_name
from training.run.storage import is_remote


def directories(settings: dict[str, Any]) -> list[tuple[str, str]]:
    """The local directories a run of ``settings`` (a subcommand's config, a dict) writes into, each with the setting
    that places it: a logger's run directory (named as cli.py names it), ``trainer.default_root_dir`` and a
    callback's ``dirpath``."""
    trainer = settings.get("trainer") or {}
    found = [(trainer.get("default_root_dir"), f"trainer.default_root_dir={trainer.get('default_root_dir')}")]
    for logger in entries(trainer.get("logger")):
        init_args = logger.get("init_args") or {}
        save_dir = init_args.get("save_dir")
        if isinstance(save_dir, str) and "name" in init_args:  # a logger of run directories, not a tracker's
            name = init_args["name"] or logger_name((settings.get("model") or {}).get("class_path"))
            run = os.path.join(save_dir, name, *([str(init_args["version"])] if init_args.get("version") else []))
            found.append((run, f"trainer.logger.init_args.save_dir={save_dir}"))
    for callback in entries(trainer.get("callbacks")):
        dirpath = (callback.get("init_args") or {}).get("dirpath")
        if dirpath:
            found.append((dirpath, f"dirpath={dirpath} of {callback.get('class_path')} in trainer.callbacks"))
    return [(path, setting) for path, setting in found if isinstance(path, str) and not is_remote(path)]


def unwritable_problem(settings: dict[str, Any]) -> str | None:
    """The paragraph when a directory the run of ``settings`` (a subcommand's config, a dict) writes into cannot be
    created or written in by this process, or None."""
    for directory, setting in directories(settings):
        path = Path(directory).absolute()
        existing = next(part for part in (path, *path.parents) if part.exists())
        if not existing.is_dir():
            why, fix = f"{existing} is a file, not a directory", "Move that file away"
        elif not os.access(existing, os.W_OK | os.X_OK):
            why = f"this user (uid {os.getuid()}) may not write in {existing}"
            fix = f"Make {existing} writable for this user"
        else:
            continue
        return (
            f"the run writes into {directory} (from {setting}), but {why}. {fix}, or give that setting another "
            "directory. Nothing was started."
        )
    return None
