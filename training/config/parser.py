"""The CLI's parser: a config mistake ends in one paragraph that names the setting and what it accepts.

jsonargparse reports a bad value under a class_path (``model``, ``data``, a callback) as a union report: every
type it tried, the Python type of the value, then the value, with the full usage of the subcommand above it,
some 50 lines. The report is text only, so this keeps its lines that say what is wrong and the value given, names
the arguments the class accepts when one of them was misspelt, and the environment variable a rejected value came
from. Checked with jsonargparse 4.53.0: tests/test_cli.py fails when
an upgrade changes the report.
"""

import difflib
import importlib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser
from omegaconf.errors import OmegaConfBaseException

from training.config.loader import environment_source

NOISE = re.compile(
    r"Does not validate against any of the (Union subtypes|types in .*)|Subtypes: .*|Errors:|Given value type: .*|"
    r"Given value: (NestedArg|Namespace|\{|\[\{).*|Expected a path but .* either not accessible or invalid|"
    r"Expected a <class 'NoneType'>|"
)
# Beside a class_path's own problem: the types the value is not, the forms a class may be given in, the value.
BESIDE_CLASS = re.compile(
    r"Expected a <class '[\w.]+'>|Not a valid subclass of \w+|Subclass types expect one of:|a class path \(str\)|"
    r"a dict (with|without) .*|Given value: .*"
)
MISSING_CLASS = re.compile(r"module '([\w.]+)' has no attribute '(\w+)'")
# A short class name that both Lightning and the template define (CSVLogger, MLFlowLogger).
AMBIGUOUS = re.compile(r"Multiple subclasses with name \w+\. .*: (.*)\.")
# A class's whole spec (a dict, a Namespace) repeats the config; a value the user typed is worth repeating.
SPEC_VALUE = re.compile(r" Got value: (\{|\[\{|\[Namespace\(|Namespace\(|NestedArg\().*")
REJECTED = re.compile(r'Parser key "([\w.]+)":.*?(?:Got|Given) value: ([^\n]*)', re.DOTALL)
CLASS_PATH = re.compile(r"class_path[ =]'([\w.]+)'")
UNKNOWN = re.compile(r"Option '(\w+)' is not accepted")
# A key at the top of a config file that belongs one level down, such as max_epochs under trainer.
TOP_LEVEL = re.compile(r"Subcommand '\w+' does not accept option '(\w+)'")
MISSING_FILE = re.compile(r"File does not exist: '([^']+)'")
MODULES_REQUIRED = re.compile(r"arguments are required: (\w+\.)?(model|data)\b")
# The files in configs/ other than ddp.yaml add to it; given alone they lack what it declares.
LAYERING = {
    "the following arguments are required: ": (
        "Start from the main config and add feature files after it (-c configs/ddp.yaml -c configs/bf16.yaml), "
        "or name the class with --model."
    ),
    "class path given previously": (
        "A config file that sets init_args without a class_path goes after the file that names the class, as in "
        "-c configs/ddp.yaml -c configs/seq2seq.yaml."
    ),
}


def accepted(class_path: str) -> list[str]:
    """The keyword arguments the class at ``class_path`` takes, or none when it cannot be imported."""
    module, _, name = class_path.rpartition(".")
    try:
        signature = inspect.signature(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [parameter.name for parameter in signature.parameters.values() if parameter.kind in kinds]


def closest_class(module: str, name: str) -> str | None:
    """The class of ``module`` whose name is closest to the misspelt ``name``, or None."""
    try:
        namespace = vars(importlib.import_module(module))
    except ImportError:
        return None
    classes = [key for key, value in namespace.items() if isinstance(value, type) and not key.startswith("_")]
    return next(iter(difflib.get_close_matches(name, classes, n=1, cutoff=0.6)), None)


def closest_file(path: str) -> str | None:
    """The file beside the missing ``path`` whose name is closest to its name (``ddp.yaml`` for ``ddp.yml``), as
    a path from the working directory where it is under it, or None."""
    missing = Path(path)
    if not missing.parent.is_dir():
        return None
    names = [entry.name for entry in missing.parent.iterdir() if entry.is_file()]
    closest = difflib.get_close_matches(missing.name, names, n=1, cutoff=0.6)
    if not closest:
        return None
    found = missing.parent / closest[0]
    return os.path.relpath(found) if found.is_relative_to(Path.cwd()) else str(found)


def class_summary(class_path: str) -> str | None:
    """The first line of the docstring of the class at ``class_path``, or None."""
    module, _, name = class_path.rpartition(".")
    try:
        doc = inspect.getdoc(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError):
        return None
    return doc.splitlines()[0].replace("``", "") if doc else None


def concise(message: str) -> str:
    """jsonargparse's ``message`` as one paragraph: what is wrong, and for a misspelt argument or class, what is
    right."""
    lines = [line.strip().removeprefix("- ") for line in message.splitlines()]
    classes = any(line.startswith(("Problem with given class_path", "Multiple subclasses")) for line in lines)
    kept = [line for line in lines if not (NOISE.fullmatch(line) or (classes and BESIDE_CLASS.fullmatch(line)))]
    kept = list(dict.fromkeys(kept))  # a union report repeats a class_path's problem once per type it tried
    paragraph = " ".join(SPEC_VALUE.sub("", line) for line in kept)
    owner, hints = None, {}
    for line in lines:  # a misspelt argument belongs to the class_path named last before it, or on its line
        owner = (CLASS_PATH.findall(line) or [owner])[-1]
        unknown = UNKNOWN.search(line)
        # A nested parser's report comes back inside its parent's, with its hint already on the line.
        if unknown and " accepts: " not in line and owner and (names := accepted(owner)):
            closest = difflib.get_close_matches(unknown[1], names, n=1, cutoff=0.5)
            hint = f" (closest to '{unknown[1]}': {closest[0]})" if closest else ""
            hints[owner] = f"{owner} accepts: {', '.join(names)}{hint}."
    for module, name in dict.fromkeys(MISSING_CLASS.findall(message)):
        if closest := closest_class(module, name):
            hints[name] = f"Closest to '{name}' in {module}: {closest}."
    for key in dict.fromkeys(TOP_LEVEL.findall(message)):
        if key in inspect.signature(Trainer.__init__).parameters:
            hints[key] = (
                f"{key} is a Trainer argument: in a config file it goes under trainer: (indented below a line "
                f"trainer:), on the command line it is --trainer.{key}."
            )
    for path in dict.fromkeys(MISSING_FILE.findall(message)):
        if closest := closest_file(path):
            hints[path] = f"Did you mean {closest}?"
    for line in lines:
        for candidate in (AMBIGUOUS.fullmatch(line) or [None, ""])[1].split(", "):
            if candidate.startswith("training.") and (summary := class_summary(candidate)):
                hints[candidate] = f"{candidate} is the template's: {summary}"
    layering = {marker: hint for marker, hint in LAYERING.items() if marker in paragraph and hint not in message}
    if not MODULES_REQUIRED.search(paragraph):  # an argument a class requires, not the model a feature file lacks
        layering.pop("the following arguments are required: ", None)
    hints |= layering
    if (rejected := REJECTED.match(message)) and (source := environment_source(*rejected.groups())):
        hints["environment"] = source
    if hints:
        paragraph = paragraph.rstrip(".") + ". " + " ".join(hints.values())
    return paragraph


class Parser(LightningArgumentParser):
    """LightningCLI's parser, with its errors as one paragraph under the tip on where to read every option."""

    def print_usage(self, file: Any = None) -> None:
        if self.format_usage().count("\n") <= 2:  # a subcommand's usage lists every option: its --help does
            super().print_usage(file)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        super().error(concise(message), ex)

    def dump(self, cfg: Any, *args: Any, **kwargs: Any) -> str:
        # The model's arguments linked from the data too: cli.py writes in the values the model gets
        # (training/config/links.py), where jsonargparse would leave them out.
        kwargs.setdefault("skip_link_targets", False)
        # What is dumped (LightningCLI's copy for the hyperparameters, the run record, --print_config) is a config
        # this parser's parse validated; validating it again took a fifth of the CLI's CPU in every process.
        # jsonargparse's own --print_config checks leniently (unknown keys only), which its parse did too.
        kwargs.setdefault("skip_validation", True)
        return super().dump(cfg, *args, **kwargs)

    def parse_args(self, args: list[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        try:
            config = super().parse_args(args, *rest, **kwargs)
        except OmegaConfBaseException as error:  # resolving ${...} over the whole config, once all files are merged
            lines = str(error).splitlines()
            key = next((line.split(":", 1)[1].strip() for line in lines if "full_key:" in line), "the config")
            self.error(
                f"{lines[0]}, in {key}. A ${{key}} names a key of the subcommand's config (${{monitor}}, "
                "${trainer.max_epochs}); --print_config without it shows the keys there are."
            )
        # jsonargparse 4.53's omegaconf+ mode leaves the list of config files out of the config it resolves; the
        # config checks name the file a setting comes from.
        subcommand = config.get("subcommand")
        if subcommand and config[subcommand].get("config") is None:
            config[subcommand].config = given_files(sys.argv[1:] if args is None else args)
        return config


def given_files(args: list[str]) -> list[str]:
    """The config files of ``-c FILE``, ``--config FILE`` and ``--config=FILE`` in ``args``, in order."""
    files = []
    for flag, value in zip(args, [*args[1:], ""], strict=True):
        if flag.startswith("--config="):
            value = flag.removeprefix("--config=")
        elif flag not in ("-c", "--config"):
            continue
        if Path(value).is_file():  # not a config given inline as YAML
            files.append(value)
    return files


def optimizer_problem(config: dict, key: str = "") -> str | None:
    """What an optimizer in ``config`` rejects in its arguments, or None.

    torch checks an optimizer's values (a negative learning rate, betas out of range) only when the model
    builds it, in every process after they all started; building each one here on one dummy parameter
    finds the same mistake before anything starts.
    """
    for name, value in config.items():
        if not isinstance(value, dict):
            continue
        where = f"{key}.{name}".removeprefix(".").replace(".init_args", "")
        class_path = value.get("class_path")
        module, _, attribute = str(class_path).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attribute) if module else None
        except (ImportError, AttributeError):
            cls = None
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            try:
                cls([torch.nn.Parameter(torch.zeros(1))], **(value.get("init_args") or {}))
            except (ValueError, TypeError) as error:
                return f"{where} ({class_path}): {error}. Fix the value in the config or on the command line."
        elif problem := optimizer_problem(value, f"{key}.{name}"):
            return problem
    return None
