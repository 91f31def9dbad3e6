"""Each private name of Lightning and jsonargparse that training/private_api.py uses still does its job.

A failure here means an upgrade took one away: the message names the use and the versions.
"""

import ast
import hashlib
import inspect
import signal
from pathlib import Path

import jsonargparse
import lightning
import pytest
import yaml
from jsonargparse import set_parsing_settings
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer import call

from tests.helpers import REPO
from training.private_api import (
    CHECKED_WITH,
    LIGHTNING_CALLBACK_DISPATCH,
    AppendingExperimentWriter,
    attach_mlflow_run,
    before_lightning_takes_signals,
    last_saved_step,
    logged_names,
    logging_step,
    omegaconf_loader,
    skip_hooks_not_overridden,
    stop_sigterm_broadcast,
    subcommand_parser,
    watch_started_processes,
)


def moved(library: str, installed: str, use: str) -> str:
    checked = CHECKED_WITH[library]
    return f"{library} {installed} (checked with {checked}): {use} no longer works; see training/private_api.py"


def test_jsonargparse_still_has_its_omegaconf_plus_loader():
    set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    loaded = omegaconf_loader()("a:\n  b: ${c}\nc: 3\n")
    use = "_optionals.get_omegaconf_loader('omegaconf+')"
    assert loaded == {"a": {"b": "${..c}"}, "c": 3}, moved("jsonargparse", jsonargparse.__version__, use)


def test_lightning_still_keeps_each_subcommands_parser_where_print_config_takes_it():
    class Parsed(Exception):
        pass

    class ParseOnly(LightningCLI):
        def before_instantiate_classes(self) -> None:
            raise Parsed(self)

    with pytest.raises(Parsed) as parsed:
        ParseOnly(BoringModel, args=["validate", "--trainer.limit_val_batches=3"])
    cli = parsed.value.args[0]
    printed = yaml.safe_load(subcommand_parser(cli, "validate").dump(cli.config.validate))
    use = "LightningCLI._parser(subcommand)"
    assert printed["trainer"]["limit_val_batches"] == 3, moved("lightning", lightning.__version__, use)


def test_lightning_still_keeps_the_step_of_a_checkpoint_callbacks_latest_save(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)
    trainer = Trainer(
        max_steps=3,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint],
    )
    assert last_saved_step(checkpoint) == 0
    trainer.fit(BoringModel())
    use = "ModelCheckpoint._last_global_step_saved"
    assert last_saved_step(checkpoint) == 2, moved("lightning", lightning.__version__, use)


def test_lightning_still_broadcasts_sigterm_after_every_batch_and_it_can_be_stopped():
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    epoch_loop = trainer.fit_loop.epoch_loop
    # The broadcast runs only in a process group of several processes: read where the loop calls it.
    advance = inspect.getsource(type(epoch_loop).advance)
    use = "the per-batch call of epoch_loop._broadcast_sigterm_tensor()"
    assert "self._broadcast_sigterm_tensor()" in advance, moved("lightning", lightning.__version__, use)
    assert stop_sigterm_broadcast(trainer), moved("lightning", lightning.__version__, use)
    assert "_broadcast_sigterm_tensor" in vars(epoch_loop), "the loop's own method would still run"


def test_lightning_still_logs_to_the_mlflow_run_it_was_given():
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger.__new__(MLFlowLogger)  # its constructor imports mlflow, which takes seconds
    attach_mlflow_run(logger, "0123")
    use = "MLFlowLogger._run_id, read by its experiment property"
    assert logger._run_id == "0123", moved("lightning", lightning.__version__, use)
    source = inspect.getsource(type(logger).experiment.fget)
    assert "if self._run_id is not None:" in source, moved("lightning", lightning.__version__, use)
    assert "self._mlflow_client.get_run(self._run_id)" in source, moved("lightning", lightning.__version__, use)


def test_lightnings_csv_writer_still_deletes_the_metrics_it_finds_from_one_method_that_can_be_kept_from_it(tmp_path):
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter

    use = "ExperimentWriter._check_log_dir_exists, which deletes metrics.csv from the constructor"
    metrics = tmp_path / ExperimentWriter.NAME_METRICS_FILE
    metrics.write_text("epoch,step\n0,0\n")
    AppendingExperimentWriter(str(tmp_path))
    assert metrics.read_text() == "epoch,step\n0,0\n", moved("lightning", lightning.__version__, use)
    ExperimentWriter(str(tmp_path))
    assert not metrics.exists(), "Lightning's writer keeps the file now: training/run/csv_logger.py may use it as it is"


class LogsAtBothLevels(BoringModel):
    def training_step(self, batch, batch_idx):
        self.log("epoch_only", 1.0, on_step=False, on_epoch=True)
        self.log("both", 2.0, on_step=True, on_epoch=True)
        self.log("step_only", 3.0)
        return super().training_step(batch, batch_idx)


def one_step_trainer(look: Callback) -> Trainer:
    """A Trainer of one training step with nothing of its own around it but ``look``."""
    return Trainer(
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[look],
    )


class NamesAtTheFirstStep(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.names = logged_names(trainer)
        self.computed = set(trainer.callback_metrics)


def test_lightning_still_keeps_every_name_logged_in_a_step_where_the_first_step_can_read_it():
    look = NamesAtTheFirstStep()
    trainer = one_step_trainer(look)
    trainer.fit(LogsAtBothLevels())
    use = "Trainer._results (the running loop's logged values)"
    assert look.names == {"epoch_only", "both", "both_step", "both_epoch", "step_only"}, moved(
        "lightning", lightning.__version__, use
    )
    assert "epoch_only" not in look.computed, "callback_metrics now holds epoch-level values at the first step"


class SigtermAtTrainStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.handler = signal.getsignal(signal.SIGTERM)


def test_lightning_still_registers_its_signal_handlers_through_its_connector_after_the_hand_over():
    use = "Trainer._signal_connector.register_signal_handlers, called in Trainer._run"
    look = SigtermAtTrainStart()
    trainer = one_step_trainer(look)
    found = signal.getsignal(signal.SIGTERM)
    handed_over = []

    def hand_over() -> None:
        handed_over.append(signal.getsignal(signal.SIGTERM))
        signal.signal(signal.SIGTERM, found)

    def taking(signum: int, frame) -> None:
        """What holds SIGTERM until the hand-over."""

    signal.signal(signal.SIGTERM, taking)
    try:
        assert before_lightning_takes_signals(trainer, hand_over), moved("lightning", lightning.__version__, use)
        trainer.fit(BoringModel())
        after_the_run = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, found)
    assert handed_over == [taking], moved("lightning", lightning.__version__, use)
    assert look.handler not in (found, taking), "Lightning's handler was not registered after the hand-over"
    assert after_the_run == found, "Lightning's teardown restored another handler than the one it found"


def test_a_trainer_run_by_processes_its_launcher_spawns_takes_no_hand_over():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False)
    assert not before_lightning_takes_signals(trainer, print)


def private_uses(path: Path) -> list[str]:
    """Imports of a private module or name, and private attributes of anything but ``self``, in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
            if is_private_path(f"{node.module}.{'.'.join(names)}"):
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if is_private_path(a.name)]
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and not is_self(node.value):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


# Documented public API of the standard library despite the underscore: os._exit ends a process at once.
PUBLIC_WITH_UNDERSCORE = {"_exit"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__") and name not in PUBLIC_WITH_UNDERSCORE


def is_private_path(dotted: str) -> bool:
    return any(map(is_private, dotted.split(".")))


def is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def test_lightnings_launcher_still_hands_the_processes_it_started_to_the_watch_of_its_module():
    from lightning.pytorch.strategies.launchers import subprocess_script

    use = "subprocess_script._launch_process_observer, called by _SubprocessScriptLauncher.launch"
    launch = inspect.getsource(subprocess_script._SubprocessScriptLauncher.launch)
    assert "_launch_process_observer(self.procs)" in launch, moved("lightning", lightning.__version__, use)
    lightnings = subprocess_script._launch_process_observer
    try:
        watch_started_processes(print)
        assert subprocess_script._launch_process_observer is print
    finally:
        subprocess_script._launch_process_observer = lightnings


def test_no_private_name_is_used_outside_private_api():
    folders = ("models", "data", "training", "scripts", "benchmarks")
    product = [REPO / "cli.py", *(path for folder in folders for path in (REPO / folder).rglob("*.py"))]
    uses = {str(p.relative_to(REPO)): private_uses(p) for p in product if p.name != "private_api.py"}
    assert not {path: found for path, found in uses.items() if found}, "import these from training/private_api.py"


def test_the_check_finds_private_uses(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from a._b import c\nfrom d import _e\nimport f._g\nx = t._h\ny = self._i\nz = o.__dict__\n")
    assert private_uses(sample) == [
        "line 1: from a._b import c",
        "line 2: from d import _e",
        "line 3: import f._g",
        "line 4: ._h",
    ]


def test_lightning_still_counts_its_logging_step_in_the_epoch_loop(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    class Steps(CSVLogger):
        written: list[int] = []

        def log_metrics(self, metrics, step=None):
            if "train_loss" in metrics or "loss" in metrics:
                self.written.append(step)

    class Noted(Callback):
        noted: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (logging_step(trainer) + 1) % 2 == 0:  # when Lightning writes, with log_every_n_steps=2
                self.noted.append(logging_step(trainer))

    class Logging(BoringModel):
        def training_step(self, batch, batch_idx):
            output = super().training_step(batch, batch_idx)
            self.log("train_loss", output["loss"])
            return output

    trainer = Trainer(
        max_steps=7,
        limit_val_batches=0,
        log_every_n_steps=2,
        logger=Steps(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[Noted()],
    )
    trainer.fit(Logging())
    use = "fit_loop.epoch_loop._batches_that_stepped, read in on_train_batch_end"
    assert Noted.noted == Steps.written == [1, 3, 5], moved("lightning", lightning.__version__, use)


class Skipping(PassThroughProfiler):
    """A trainer with this profiler is one the skipping dispatch skips for."""


class RecordsHooks(Callback):
    """Every per-step hook it defines, with the module's fx name while it runs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.calls.append(("on_train_batch_start", pl_module._current_fx_name, batch_idx))

    def on_before_backward(self, trainer, pl_module, loss):
        self.calls.append(("on_before_backward", pl_module._current_fx_name, loss.requires_grad))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.calls.append(("on_train_batch_end", pl_module._current_fx_name, batch_idx))


def test_lightning_still_dispatches_callback_hooks_as_checked_and_the_skipping_copy_calls_the_same_hooks(monkeypatch):
    use = "trainer.call._call_callback_hooks, whose loop skip_hooks_not_overridden repeats without the profiler"
    source = inspect.getsource(LIGHTNING_CALLBACK_DISPATCH)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert digest == "c413fb9a6a9ce1a3", moved("lightning", lightning.__version__, use)
    empty = []  # Callback's own on_before_zero_grad, which every callback here leaves as it is
    monkeypatch.setattr(Callback, "on_before_zero_grad", lambda self, trainer, pl_module, optimizer: empty.append(1))
    monkeypatch.setattr(call, "_call_callback_hooks", LIGHTNING_CALLBACK_DISPATCH)
    skip_hooks_not_overridden(lambda trainer: isinstance(trainer.profiler, Skipping))
    skip_hooks_not_overridden(lambda trainer: False)  # a second call changes nothing
    recorded = {}
    for profiler in (Skipping(), PassThroughProfiler()):
        recorder = RecordsHooks()
        trainer = Trainer(
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[recorder, Callback()],
            profiler=profiler,
        )
        trainer.fit(BoringModel())
        recorded[type(profiler)] = (recorder.calls, len(empty))
        empty.clear()
    assert recorded[Skipping] == (recorded[PassThroughProfiler][0], 0)
    assert recorded[PassThroughProfiler][1] == 2 * 2  # Lightning's own dispatch calls both callbacks' every step
    assert recorded[Skipping][0][:3] == [
        ("on_train_batch_start", "on_train_batch_start", 0),
        ("on_before_backward", "on_before_backward", True),
        ("on_train_batch_end", "on_train_batch_end", 0),
    ]
