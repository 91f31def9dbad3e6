"""Shapes and token ids the model takes from the data: stated once, never silently replaced, shown as used.

cli.py links each data module attribute below to the model's init argument of the same meaning, once the data
module is built (``link_arguments(..., apply_on="instantiate")``); a model without the argument, or a data module
without the attribute, is left out, as jsonargparse leaves it. jsonargparse gives the model the data's value
whatever the user gave for that argument, and shows the argument nowhere; so a value given in a config file or on
the command line that differs from the data's is refused here, naming both, and ``--print_config`` and the run's
``config.yaml`` hold the value the model gets.
"""

import re
import sys
from argparse import ArgumentError
from collections.abc import Callable
from typing import Any

from jsonargparse import ArgumentParser, Namespace
from lightning.pytorch import LightningDataModule

# data module attribute -> model init argument
LINKS = {
    "num_features": "in_features",
    "num_targets": "out_features",
    "vocab_size": "vocab_size",
    "pad_id": "pad_id",
    "bos_id": "bos_id",
    "eos_id": "eos_id",
}
PRINT_CONFIG = re.compile(r"--print_config(?:=(.*))?")
# --print_config's flags as jsonargparse 4.53 maps them onto its dump's arguments (skip_null: its former name).
PRINT_FLAGS = {"skip_default": "skip_default", "skip_unset": "skip_unset", "skip_null": "skip_unset"}


def link_data_to_model(parser: ArgumentParser) -> None:
    for source, target in LINKS.items():
        parser.link_arguments(f"data.{source}", f"model.init_args.{target}", apply_on="instantiate")


def given_model(parser: ArgumentParser, args: Any, subcommand: str) -> dict[str, Any]:
    """The model section as ``args`` (the command line, with its config files) gives it: its ``class_path`` and the
    ``init_args`` given a value, as a dict. A parse without defaults holds only what was given (jsonargparse fills in
    a class's own defaults otherwise)."""
    exit_on_error, parser.exit_on_error = parser.exit_on_error, False
    try:
        if isinstance(args, dict | Namespace):
            given = parser.parse_object(args, defaults=False)
        else:
            given = parser.parse_args(args, defaults=False)
    except ArgumentError:  # what was given does not stand alone (a ${key} only a default defines): nothing to check
        return {}
    finally:
        parser.exit_on_error = exit_on_error
    model = given.get(f"{subcommand}.model")
    return model.as_dict() if isinstance(model, Namespace) else {}


def linked_values(config: Namespace, datamodule: Any) -> dict[str, Any]:
    """What the links give the model of ``config`` (a subcommand's) from ``datamodule``: ``{argument: value}``."""
    init_args = config.get("model.init_args")
    return {
        target: getattr(datamodule, source)
        for source, target in LINKS.items()
        if init_args and target in init_args and hasattr(datamodule, source)
    }


def link_problem(given: Callable[[], dict[str, Any]], linked: dict[str, Any], config: Namespace) -> str | None:
    """The paragraph for the linked arguments given (``given()``: the model section, as ``given_model`` returns it)
    that differ from the data's (``linked``), or None. ``config`` (a subcommand's) holds each argument's given value,
    or else the model's default: only where that differs from the data's can a given value differ, so only then is
    ``given``, a parse of its own, called."""
    if all(config.get(f"model.init_args.{target}") == value for target, value in linked.items()):
        return None
    init_args = given().get("init_args") or {}
    values = {target: init_args[target] for target in LINKS.values() if target in init_args}
    sources = {target: source for source, target in LINKS.items()}
    clashes = [target for target in linked if target in values and values[target] != linked[target]]
    if not clashes:
        return None
    data = config.get("data.class_path")
    told = "; ".join(
        f"model.init_args.{target}={values[target]!r} is given, but {data} has {sources[target]}={linked[target]!r}"
        for target in clashes
    )
    names = ", ".join(f"model.init_args.{target}" for target in clashes)
    return (
        f"{told}. cli.py sets {names} from the data: remove it from the config files and the command line (the model "
        "then gets the data's value; --print_config shows it), or change the data."
    )


def record_links(config: Namespace, datamodule: Any, given: Callable[[], dict[str, Any]]) -> str | None:
    """Write the values the model of ``config`` (a subcommand's, which ``config.yaml`` records) got from
    ``datamodule`` into ``config``; or the paragraph for the values given (``given()``) that differ, written
    nowhere."""
    linked = linked_values(config, datamodule)
    if problem := link_problem(given, linked, config):
        return problem
    for target, value in linked.items():
        config[f"model.init_args.{target}"] = value
    return None


def build_data(config: Namespace) -> LightningDataModule | None:
    """The data module of ``config`` (a subcommand's), built on its own; None when the config names none."""
    if not isinstance(config.get("data"), Namespace):
        return None
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningDataModule, "data")
    return parser.instantiate_classes(parser.parse_object({"data": config.data.as_dict()})).data


def print_config_with_links(
    parser: ArgumentParser, subparser: Callable[[str], ArgumentParser], args: list[str]
) -> None:
    """``--print_config`` in the command line ``args``, as the classes get the config, linked values included; exits.
    Returns, printing nothing, when ``--print_config`` is not asked for, with a flag this does not know, or the config
    does not parse whole: jsonargparse then prints what it has (a starting config without a model), or names the
    mistake; and, after a note, when the data module cannot be built on this machine.

    jsonargparse prints while it parses, before any class is built, so this parses without ``--print_config``,
    builds the data module, and prints the config with the linked values, as jsonargparse would with the flags
    given, from ``subparser(subcommand)``: the subcommand's parser."""
    rest = [arg for arg in args if not PRINT_CONFIG.fullmatch(arg)]
    if len(rest) == len(args):
        return
    flags = [
        flag for arg in args if (asked := PRINT_CONFIG.fullmatch(arg)) for flag in (asked[1] or "").split(",") if flag
    ]
    if not set(flags) <= set(PRINT_FLAGS):
        return
    exit_on_error, parser.exit_on_error = parser.exit_on_error, False  # a config that does not parse raises
    try:
        config = parser.parse_args(rest)
    except ArgumentError:
        return
    finally:
        parser.exit_on_error = exit_on_error
    subcommand = config.get("subcommand")
    if not subcommand:
        return
    try:
        datamodule = build_data(config[subcommand])
    except Exception as error:  # files only the training machines have, or a setting the run itself names
        init_args = config[subcommand].get("model.init_args") or {}
        if shown := [f"model.init_args.{target}" for target in LINKS.values() if target in init_args]:
            reason = error.__cause__ or error  # jsonargparse's report on each type it tried wraps the data's own
            print(
                f"note: --print_config could not build the data module here ({reason}), so {', '.join(shown)} show "
                "the model's own defaults; a run takes them from the data.",
                file=sys.stderr,
            )
        return
    if problem := record_links(config[subcommand], datamodule, lambda: given_model(parser, rest, subcommand)):
        parser.error(problem)
    options = {"skip_unset": False} | {PRINT_FLAGS[flag]: True for flag in flags}
    sys.stdout.write(subparser(subcommand).dump(config[subcommand], **options))
    parser.exit()
