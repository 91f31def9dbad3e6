"""The private names of Lightning and jsonargparse that the template relies on, all in this one module.

A leading underscore means the library may rename or drop the name in any release. Each use says why no
public API serves and the version it was checked against (CHECKED_WITH); tests/test_private_api.py fails,
naming the use and both versions, when an upgrade takes one away. Everything else in the template imports
from here, so an upgrade is checked in one place.
"""

import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import lightning
import torch
from jsonargparse._optionals import get_omegaconf_loader
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher, subprocess_script
from lightning.pytorch.trainer import call
from torch.utils.data._utils.worker import _worker_loop

CHECKED_WITH = {"lightning": "2.6.6", "jsonargparse": "4.53.0"}
# The oldest Lightning the template supports (pyproject.toml) differs where a use says so; checked with 2.5.2 and 2.5.6.
LIGHTNING_2_5 = lightning.__version__.startswith("2.5.")
LIGHTNING_CALLBACK_DISPATCH = call._call_callback_hooks


def omegaconf_loader() -> Callable[[str], Any]:
    """jsonargparse's loader for ``parser_mode="omegaconf+"``, unwrapped: YAML, with ``${key}`` made relative to
    where it appears when ``omegaconf_absolute_to_relative_paths`` is set.

    training/config_loader.py wraps it so a YAML or interpolation error names its file. jsonargparse registers this
    loader lazily, on the first value it parses, so its public ``get_loader("omegaconf+")`` has nothing to return
    before then, and after cli.py's first run it would return cli.py's own wrapper.
    """
    return get_omegaconf_loader("omegaconf+")


def subcommand_parser(cli: LightningCLI, subcommand: str) -> LightningArgumentParser:
    """The parser of ``cli``'s ``subcommand``, the one ``--print_config`` prints the subcommand's config with: the one
    LightningCLI saves the subcommand's config with."""
    return cli._parser(subcommand)


def last_saved_step(callback: ModelCheckpoint) -> int:
    """The global step of ``callback``'s latest save (0 before any).

    training/checkpoints/last.py writes last.ckpt at the end of training when the latest save was at an earlier step;
    ModelCheckpoint keeps that step only in ``_last_global_step_saved``.
    """
    return callback._last_global_step_saved


def logging_step(trainer: Trainer) -> int:
    """The step Lightning writes the metrics of the running training batch with, read in ``on_train_batch_end``.

    training/step_time/callback.py writes its figures to the loggers itself, at that step: through ``self.log``
    each of them cost a fifth of a millisecond of Python every logging interval. Lightning counts the batches that
    stepped an optimizer, its logging step (``global_step`` counts every optimizer's steps), only in the epoch loop's
    ``_batches_that_stepped``.
    """
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def stop_sigterm_broadcast(trainer: Trainer) -> bool:
    """Turn off the broadcast of Lightning's SIGTERM flag after every training batch; False where it moved.

    training/checkpoints/preemption.py agrees on stopping once a second instead (its docstring says why); Lightning has
    no setting for its own broadcast, which costs a short step on gloo a tenth of its time.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        return False
    epoch_loop._broadcast_sigterm_tensor = lambda: None
    return True


def attach_mlflow_run(logger: MLFlowLogger, run_id: str) -> None:
    """Make Lightning's MLFlowLogger log to the existing MLflow run ``run_id`` instead of creating one.

    training/run/mlflow_logger.py finds the run of a run id on the logger's first use, on global rank 0 once the
    processes started; Lightning takes an existing run only as the constructor's ``run_id``, which every process
    (and node) builds before it knows its rank, and which would make them all talk to the server.
    """
    logger._run_id = run_id


def logged_names(trainer: Trainer) -> set[str]:
    """Every name the module has logged so far in the running loop, as callbacks find it in
    ``trainer.callback_metrics`` once Lightning has computed it: ``name``, and ``name_step``/``name_epoch`` for a
    value logged at both levels.

    training/callbacks/monitor_check.py needs them in the first training step, when ``callback_metrics`` holds the
    values of the step only: a value logged with ``on_epoch=True`` alone appears there at the epoch's end. Lightning
    keeps every logged value's settings in the loop's result collection, ``trainer._results``, public in no other way.
    """
    names = set()
    for result in (trainer._results or {}).values():
        meta = result.meta
        indexed = meta.add_dataloader_idx and meta.dataloader_idx is not None
        suffix = f"/dataloader_idx_{meta.dataloader_idx}" if indexed else ""
        levels = [on_step for on_step, logged in ((True, meta.on_step), (False, meta.on_epoch)) if logged]
        names |= {meta.name + suffix} | {meta.forked_name(on_step) + suffix for on_step in levels}
    return names


def watch_started_processes(watch: Callable[[list[subprocess.Popen]], None]) -> None:
    """Have Lightning's launcher hand the processes it starts on a node to ``watch`` instead of its own watch.

    Lightning's watch SIGKILLs every process of the node, the launching one included, up to 5 s after one of them
    ended with an error, before any can say what happened (training/job/node_processes.py says it instead). The launcher
    has no setting for it: it calls the function by its name in the launcher's module.
    """
    subprocess_script._launch_process_observer = watch


def before_lightning_takes_signals(trainer: Trainer, hand_over: Callable[[], None]) -> bool:
    """Have ``trainer`` call ``hand_over`` just before it registers its own signal handlers; False, and nothing
    arranged, where the run happens in processes the launcher hands the trainer to (``ddp_spawn``, ``ddp_fork``).

    training/job/stop_signal.py holds SIGTERM from the CLI's checks until then and gives back the handler it found,
    which Lightning saves and restores after the run as it would without it. Lightning registers its handlers in
    ``Trainer._run`` once the module is set up and the checkpoint restored, through ``trainer._signal_connector``,
    with no hook there; only its subprocess-script launcher (DDP's default) runs the trainer in the launching process.
    """
    launcher = trainer.strategy.launcher
    if launcher is not None and not isinstance(launcher, _SubprocessScriptLauncher):
        return False
    connector = trainer._signal_connector

    def registering() -> None:
        del connector.register_signal_handlers  # Lightning's own method again
        hand_over()
        connector.register_signal_handlers()

    connector.register_signal_handlers = registering
    return True


def is_data_loader_worker(process: BaseProcess) -> bool:
    """Whether ``process``, multiprocessing's object for a process it has just forked, is a DataLoader worker.

    training/job/forked.py leaves the stop signals to a worker's rank. torch starts every worker (of the template's
    loaders, a user's, Lightning's re-made ones) with the target ``_worker_loop``, which multiprocessing keeps only in
    ``_target``; checked with torch 2.8, 2.11, 2.13 and 2.15.
    """
    return getattr(process, "_target", None) is _worker_loop


# A fork waits for a read of the threads' frames to end. CPython before 3.11.10 reads them holding its runtime's lock,
# and a garbage collection during the read can run Python code and hand over the GIL: a DataLoader worker forked then
# inherits the lock held and hangs before it runs a line, and never ends with its rank (CPython gh-112275).
READING_FRAMES = threading.Lock()
os.register_at_fork(
    before=READING_FRAMES.acquire, after_in_parent=READING_FRAMES.release, after_in_child=READING_FRAMES.release
)


def main_thread_stack(frames: int) -> list[str]:
    """The innermost ``frames`` frames of the main thread's Python stack, as traceback prints them, read from another
    thread while the main thread may wait in C.

    training/heartbeat/stall.py names where a stalled process waits; CPython shows another thread's frame only through
    ``sys._current_frames`` (documented, with a leading underscore all the same), which this template checked with
    CPython 3.11 and 3.12.
    """
    with READING_FRAMES:
        frame = sys._current_frames().get(threading.main_thread().ident)
    return traceback.format_stack(frame)[-frames:] if frame is not None else []


class AppendingExperimentWriter(ExperimentWriter):
    """Lightning's CSV experiment writer, keeping the ``metrics.csv`` it finds in its directory.

    training/run/csv_logger.py continues a run's metrics.csv across attempts; Lightning's writer deletes the file from
    its constructor, in ``_check_log_dir_exists``, and no argument turns that off.
    """

    def _check_log_dir_exists(self) -> None:
        """Keep the file: the logger appends to it."""


def skip_hooks_not_overridden(skips: Callable[[Trainer], bool]) -> None:
    """Have Lightning call, for the trainers where ``skips(trainer)``, only the callback hooks a callback overrides:
    the rest are Callback's own, which do nothing.

    training/run/profiler.py's NoProfiler asks for it: Lightning calls every hook of every callback, a dozen hooks a
    training step whether a callback defines them or not, each inside the profiler's context manager with a name made
    from the callback's ``state_key`` (a string of its settings, for a ModelCheckpoint): with the template's 15
    callbacks, about 100 calls a step that do nothing. Where a profiler records them, or ``monitoring_callbacks``
    picks callbacks, Lightning's own ``trainer.call._call_callback_hooks`` runs; every module of Lightning calls it by
    its name in that module, with no setting to skip a hook.
    """
    if call._call_callback_hooks is not LIGHTNING_CALLBACK_DISPATCH:
        return

    def call_callback_hooks(
        trainer: Trainer, hook_name: str, *args: Any, monitoring_callbacks: bool | None = None, **kwargs: Any
    ) -> None:
        if monitoring_callbacks is not None or not skips(trainer):
            LIGHTNING_CALLBACK_DISPATCH(trainer, hook_name, *args, monitoring_callbacks=monitoring_callbacks, **kwargs)
            return
        call.log.debug(f"{trainer.__class__.__name__}: calling callback hook: {hook_name}")
        own = getattr(Callback, hook_name, None)
        pl_module = trainer.lightning_module
        if pl_module:  # as Lightning's: the module's fx name is the hook's while it runs, then the one before
            previous, pl_module._current_fx_name = pl_module._current_fx_name, hook_name
        for callback in trainer.callbacks:
            hook = getattr(callback, hook_name)
            if callable(hook) and getattr(hook, "__func__", None) is not own:
                hook(trainer, trainer.lightning_module, *args, **kwargs)
        if pl_module:
            pl_module._current_fx_name = previous

    call._call_callback_hooks = call_callback_hooks


def ckpt_path_read_as_lightning_2_6(cli_class: type[LightningCLI]) -> type[LightningCLI]:
    """``cli_class`` (training/config/cli.py's CLI), reading a ``--ckpt_path`` file's hyperparameters as Lightning 2.6
    does where Lightning is 2.5.

    A module saved under subclass mode (every run of this template) keeps its class among its hyperparameters as
    ``_class_path``; Lightning 2.5's ``LightningCLI._parse_ckpt_path`` hands it to the parser as an argument of the
    model, and validate, test or predict with --ckpt_path stops with "Option '_class_path' is not accepted". Lightning
    2.6 makes it the model's class_path, as ``parse_ckpt_path`` below does.
    """
    if LIGHTNING_2_5:
        cli_class._parse_ckpt_path = parse_ckpt_path
    return cli_class


def parse_ckpt_path(cli: LightningCLI) -> None:
    """Lightning 2.6.6's ``LightningCLI._parse_ckpt_path``."""
    subcommand = cli.config.get("subcommand")
    ckpt_path = subcommand and cli.config[subcommand].get("ckpt_path")
    if not ckpt_path or not Path(ckpt_path).is_file():
        return
    hparams = torch.load(ckpt_path, weights_only=True, map_location="cpu").get("hyper_parameters", {})
    hparams.pop("_instantiator", None)
    if not hparams:
        return
    if "_class_path" in hparams:
        hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
    try:
        cli.config = cli.parser.parse_object({subcommand: {"model": hparams}}, cli.config)
    except SystemExit:
        sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
        raise
