"""How cli.py reads YAML: OmegaConf interpolation, ``gpus_or``, ``run_id`` and ``file_name`` resolvers, errors naming
the file, and which keys the files take from environment variables.

jsonargparse's ``omegaconf+`` mode resolves the interpolations over the whole config once every file and flag is
merged: ``${monitor}`` in configs/ddp.yaml is what ``--monitor`` or a later file sets. Each file is also resolved on
its own as it is read, so an error of a resolver or an environment variable names its file."""

import contextlib
import os
import re
from collections.abc import Callable
from typing import Any

import torch
import yaml
from jsonargparse import set_loader, set_parsing_settings
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException

from training.private_api import omegaconf_loader


def gpus_or(cpu_processes: int) -> int | str:
    """Value for ``trainer.devices``: every visible GPU, or ``cpu_processes`` processes without one."""
    return "auto" if torch.cuda.is_available() else int(cpu_processes)


# libyaml's safe loader where PyYAML has it: the pure-Python one takes about 6 ms for configs/ddp.yaml, which every
# process reads more than once.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(text: str) -> Any:
    """``text`` as ``yaml.safe_load`` reads it."""
    return yaml.load(text, Loader=SAFE_LOADER)


RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")
ENV = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)")
# The keys of the config files read so far whose value comes from an environment variable: key -> (variable, file).
# The parser reports only the key and the value it rejects, which the user may have set in the environment.
ENVIRONMENT_KEYS: dict[str, tuple[str, str]] = {}


def run_id(default: str) -> str:
    """Value for the logger's ``version``: ``RUN_ID`` from the environment, else ``default``; a name, never a
    path, so a run is written inside the log directory whatever RUN_ID holds."""
    value = os.environ.get("RUN_ID", default)
    if not RUN_NAME.fullmatch(value) or value in (".", ".."):
        raise ValueError(
            f"RUN_ID={value!r} is not a run name: use letters, digits, '-', '_' and '.' (not '.' or '..' alone), "
            "at most 100 characters, e.g. RUN_ID=lr-3e-4."
        )
    return value


def file_name(metric: str) -> str:
    """``metric`` as part of a file name: ``val/loss`` -> ``val_loss`` (a ``/`` would make a directory)."""
    return metric.replace("/", "_")


def resolve_in_file(value: Any, node: Any) -> None:
    """Resolve each interpolation of ``value`` (a config file's YAML) within the file (``node``, the file as OmegaConf
    reads it), so a resolver's or an environment variable's error names the file; one that names a key the file
    lacks is for the whole config to resolve."""
    for key in value.keys() if isinstance(value, dict) else range(len(value)):
        if isinstance(value[key], dict | list):
            resolve_in_file(value[key], node[key])
        elif isinstance(value[key], str) and "${" in value[key]:
            with contextlib.suppress(InterpolationKeyError):  # a key of the whole config
                node[key]


def load_checking_the_file(value: str) -> Any:
    """``value`` as jsonargparse's ``omegaconf+`` loader reads it, once its interpolations resolve within the file."""
    loaded = omegaconf_loader()(value)
    if isinstance(loaded, dict | list) and "${" in value:  # most values the parser loads have no interpolation
        resolve_in_file(loaded, OmegaConf.create(loaded))
    return loaded


def naming_the_file(load: Callable[[str], Any]) -> Callable[..., Any]:
    """Wrap a config loader so YAML and interpolation errors say which file they come from."""

    def load_config(value: str, path: str = "") -> Any:
        source = f"config file {path}" if path else "a command-line value"
        try:
            loaded = load(value)
        except yaml.YAMLError as error:
            raise yaml.YAMLError(f"{source} is not valid YAML: {error}") from error
        except OmegaConfBaseException as error:
            rejected = resolver_error(error)
            if rejected is not None:  # a resolver rejecting a value: its own message says what and how to fix it
                raise yaml.YAMLError(f"{source}: {rejected}") from error
            raise yaml.YAMLError(
                f"{source}: {error}\n${{oc.env:VAR}} needs VAR set or a default, as in ${{oc.env:VAR,default}}."
            ) from error
        if path:
            note_environment_keys(read_yaml(value), path)
        return loaded

    return load_config


def note_environment_keys(node: Any, path: str, key: str = "") -> None:
    """Note which keys of ``node`` (a config file's YAML, unresolved) read an environment variable; a later file
    that sets such a key itself takes it back."""
    if isinstance(node, dict):
        for name, value in node.items():
            note_environment_keys(value, path, f"{key}.{name}".removeprefix("."))
    elif isinstance(node, str) and (variable := ENV.search(node)):
        ENVIRONMENT_KEYS[key] = (variable[1], path)
    else:
        ENVIRONMENT_KEYS.pop(key, None)


def environment_source(key: str, value: str) -> str | None:
    """The sentence naming the environment variable the rejected ``value`` of ``key`` came from, or None."""
    variable, path = ENVIRONMENT_KEYS.get(key, ("", ""))
    if variable not in os.environ or os.environ[variable].strip() != value.strip():  # the value came from elsewhere
        return None
    return (
        f"{path} takes {key} from the environment variable {variable}: "
        f"set {variable} to a value it accepts, or unset it."
    )


def resolver_error(error: BaseException) -> ValueError | None:
    """The ValueError a resolver raised, which OmegaConf wraps in its own errors, if that is what ``error`` is."""
    cause: BaseException | None = error
    while cause is not None and (isinstance(cause, OmegaConfBaseException) or not isinstance(cause, ValueError)):
        cause = cause.__cause__ or cause.__context__
    return cause


def use_omegaconf_loader() -> None:
    """Make ``parser_mode="omegaconf+"`` load each file with ``naming_the_file`` and know ``${gpus_or:N}``,
    ``${run_id:default}`` and ``${file_name:metric}``."""
    ENVIRONMENT_KEYS.clear()
    OmegaConf.register_resolver("gpus_or", gpus_or, replace=True)
    OmegaConf.register_resolver("run_id", run_id, replace=True)
    OmegaConf.register_resolver("file_name", file_name, replace=True)
    # ${monitor} names the subcommand's top-level key, as it reads in a file of the subcommand's config.
    set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    set_loader("omegaconf+", naming_the_file(load_checking_the_file), (yaml.YAMLError,))
