"""How cli.py reads YAML: OmegaConf interpolation, a ``gpus_or`` resolver, and errors that name the file."""

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


def naming_the_file(load: Callable[[str], Any]) -> Callable[..., Any]:
    """Wrap a config loader so YAML and interpolation errors say which file they come from."""

    def load_config(value: str, path: str = "") -> Any:
        source = f"config file {path}" if path else "a command-line value"
        try:
            return load(value)
        except yaml.YAMLError as error:
            raise yaml.YAMLError(f"{source} is not valid YAML: {error}") from error
        except OmegaConfBaseException as error:
            raise yaml.YAMLError(
                f"{source}: {error}\nEach config file is resolved on its own, so ${{...}} can only refer to keys of "
                "the same file, and ${oc.env:VAR} needs VAR set or a default, as in ${oc.env:VAR,default}."
            ) from error

    return load_config


def use_omegaconf_loader() -> None:
    """Make ``parser_mode="omegaconf"`` load with ``naming_the_file`` and know ``${gpus_or:N}``."""
    OmegaConf.register_resolver("gpus_or", gpus_or, replace=True)
    set_loader("omegaconf", naming_the_file(omegaconf_loader()), (yaml.YAMLError,))
