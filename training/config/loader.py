"""How cli.py reads YAML: OmegaConf interpolation, ``gpus_or`` and ``run_id`` resolvers, errors naming the file,
and which keys the files take from environment variables."""

import os
import re
from collections.abc import Callable
from typing import Any

import torch
import yaml
from jsonargparse import set_loader
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from training.private_api import omegaconf_loader


def gpus_or(cpu_processes: int) -> int | str:
    """Value for ``trainer.devices``: every visible GPU, or ``cpu_processes`` processes without one."""
    return "auto" if torch.cuda.is_available() else int(cpu_processes)


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
                f"{source}: {error}\nEach config file is resolved on its own, so ${{...}} can only refer to keys of "
                "the same file, and ${oc.env:VAR} needs VAR set or a default, as in ${oc.env:VAR,default}."
            ) from error
        if path:
            note_environment_keys(yaml.safe_load(value), path)
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
    """Make ``parser_mode="omegaconf"`` load with ``naming_the_file`` and know ``${gpus_or:N}`` and
    ``${run_id:default}``."""
    ENVIRONMENT_KEYS.clear()
    OmegaConf.register_resolver("gpus_or", gpus_or, replace=True)
    OmegaConf.register_resolver("run_id", run_id, replace=True)
    set_loader("omegaconf", naming_the_file(omegaconf_loader()), (yaml.YAMLError,))
