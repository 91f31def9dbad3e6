"""The template's callbacks and plugins stay on whatever a user's config adds.

A list given in a later config file or on the command line replaces the earlier list whole (jsonargparse's rule):
``trainer: {callbacks: [EarlyStopping]}`` in a user's file would drop configs/ddp.yaml's last.ckpt, run lock and
stop-signal save without a word. Such a list is refused, naming ``callbacks+:``, which adds to the list; ``turn_off``
names the entries a run leaves out on purpose.
"""

from pathlib import Path
from typing import Any

import yaml

from training.config.loader import read_yaml

LISTS = ("callbacks", "plugins")
CONFIG_FLAGS = ("-c", "--config")
LIST_FLAGS = tuple(f"--trainer.{key}{add}" for key in LISTS for add in ("", "+"))


def entry_name(entry: Any) -> str:
    """A list entry's class name (``StepTime`` for ``{class_path: training.StepTime}``), or the entry as written."""
    written = entry.get("class_path", "") if isinstance(entry, dict) else getattr(entry, "class_path", entry)
    return str(written).rpartition(".")[2]


def file_lists(path: str) -> list[tuple[str, list[Any], bool]]:
    """``(key, entries, adds)`` for each list of ``LISTS`` under ``trainer:`` in the config file at ``path``;
    ``adds`` for ``key+:``. A file that cannot be read gives none: the parser has already said what is wrong."""
    try:
        trainer = (read_yaml(Path(path).read_text()) or {}).get("trainer")
    except (OSError, yaml.YAMLError, AttributeError):
        return []
    found = []
    for key, value in trainer.items() if isinstance(trainer, dict) else ():
        if (name := str(key).removesuffix("+")) in LISTS:
            found.append((name, value if isinstance(value, list) else [value], str(key).endswith("+")))
    return found


def flag_list(option: str, value: str) -> tuple[str, list[Any], bool] | None:
    """``(key, entries, adds)`` for a command-line ``--trainer.callbacks=...`` or ``--trainer.callbacks+=...``."""
    key = option.removeprefix("--trainer.")
    if option == key or key.removesuffix("+") not in LISTS:
        return None
    try:
        entries = read_yaml(value)
    except yaml.YAMLError:
        entries = value
    return key.removesuffix("+"), entries if isinstance(entries, list) else [entries], key.endswith("+")


def given_lists(args: list[str]) -> list[tuple[str, str, list[Any], bool]]:
    """``(where, key, entries, adds)`` for each list that ``args`` give, in the order the parser applies them;
    ``where`` says which file or flag gave it."""
    given = []
    words = iter(args)
    for word in words:
        option, equals, value = word.partition("=")
        if not equals and option in CONFIG_FLAGS + LIST_FLAGS:
            value = next(words, "")
        if option in CONFIG_FLAGS:
            given += [(f"of {value}", key, entries, adds) for key, entries, adds in file_lists(value)]
        elif listed := flag_list(option, value):
            given.append((f"given with {option.removesuffix('+')}", *listed))
    return given


def lists_problem(args: list[str] | None, trainer: Any, turned_off: list[str]) -> str | None:
    """The paragraph for a list in ``args`` that leaves out what an earlier one gave, other than ``turned_off``,
    or for a name in ``turned_off`` that no list gave (``trainer``: the parsed trainer config); or None."""
    kept: dict[str, tuple[str, list[str]]] = {}
    named = {entry_name(entry) for key in LISTS for entry in (trainer.get(key) or [])}
    turned_off = [entry_name(name) for name in turned_off]
    for where, key, entries, adds in given_lists(args or []):
        names = [entry_name(entry) for entry in entries]
        named.update(names)
        earlier, before = kept.get(key, ("", []))
        dropped = [name for name in before if name not in names and name not in turned_off]
        if not adds and dropped:
            return (
                f"the {key} list {where} replaces the one {earlier}, leaving out {', '.join(dropped)}: a list given "
                f"later replaces an earlier one whole. To add to the list, write {key}+: in place of {key}: in the "
                f"file (on the command line, --trainer.{key}+=...); to leave an entry out on purpose, name it in "
                f"turn_off (turn_off: [{dropped[0]}] in a config file, or --turn_off=[{dropped[0]}])."
            )
        kept[key] = (earlier or where, before + names) if adds else (where, names)
    if unknown := [name for name in turned_off if name not in named]:
        return (
            f"turn_off names {', '.join(unknown)}, which {'is' if len(unknown) == 1 else 'are'} not among the run's "
            f"callbacks and plugins: {', '.join(sorted(named))}. Name an entry by its class name, such as StepTime."
        )
    return None


def turn_off(trainer: Any, names: list[str]) -> None:
    """Leave the entries named in ``names`` out of the lists of ``trainer``, the parsed trainer config."""
    names = [entry_name(name) for name in names]
    for key in LISTS:
        if isinstance(trainer.get(key), list):
            trainer[key] = [entry for entry in trainer[key] if entry_name(entry) not in names]
