"""A user's callbacks or plugins list adds to the template's, or is refused naming what it would drop; turn_off
leaves one out on purpose. Plain LightningCLI lets the later list replace the earlier one without a word."""

import pytest
import yaml
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from tests.helpers import DDP_YAML, SINGLE_PROCESS
from training import LastCheckpoint, StepTime

TEMPLATE_CALLBACKS = [
    entry["class_path"].rpartition(".")[2]
    for entry in yaml.safe_load(open(DDP_YAML).read())["trainer"]["callbacks"]  # noqa: SIM115
]
EARLY_STOPPING = (
    "    - class_path: lightning.pytorch.callbacks.EarlyStopping\n      init_args:\n        monitor: val/loss\n"
)
RUN = [*SINGLE_PROCESS, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]


def refused(run_cli, capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        run_cli("fit", "-c", DDP_YAML, *args)
    assert exit_.value.code != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("given", ["file", "flag"])
def test_a_list_that_would_replace_the_templates_callbacks_is_refused_naming_them(run_cli, capsys, tmp_path, given):
    (tmp_path / "mine.yaml").write_text(f"trainer:\n  callbacks:\n{EARLY_STOPPING}")
    args = (
        ["-c", "mine.yaml"]
        if given == "file"
        else ["--trainer.callbacks=EarlyStopping", "--trainer.callbacks.monitor=val/loss"]
    )
    where = "of mine.yaml" if given == "file" else "given with --trainer.callbacks"
    assert refused(run_cli, capsys, *args, *RUN) == (
        f"error: the callbacks list {where} replaces the one of {DDP_YAML}, leaving out "
        f"{', '.join(TEMPLATE_CALLBACKS)}: a list given later replaces an earlier one whole. To add to the list, "
        "write callbacks+: in place of callbacks: in the file (on the command line, --trainer.callbacks+=...); to "
        "leave an entry out on purpose, name it in turn_off (turn_off: [ModelCheckpoint] in a config file, or "
        "--turn_off=[ModelCheckpoint])."
    )
    assert not (tmp_path / "logs").exists()


def test_a_plugins_list_that_would_replace_the_templates_is_refused(run_cli, capsys, tmp_path):
    (tmp_path / "mine.yaml").write_text("trainer:\n  plugins:\n    - lightning.pytorch.plugins.TorchCheckpointIO\n")
    paragraph = refused(run_cli, capsys, "-c", "mine.yaml", *RUN)
    assert paragraph.startswith(
        f"error: the plugins list of mine.yaml replaces the one of {DDP_YAML}, leaving out AtomicCheckpointIO: "
    )
    assert "write plugins+: in place of plugins:" in paragraph and "--turn_off=[AtomicCheckpointIO]" in paragraph


def test_plain_lightning_cli_lets_a_later_list_drop_the_earlier_callbacks_without_a_word(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args:\n        save_last: true\n"
    )
    (tmp_path / "mine.yaml").write_text(f"trainer:\n  callbacks:\n{EARLY_STOPPING}")
    configs = ["-c", str(tmp_path / "base.yaml"), "-c", str(tmp_path / "mine.yaml")]
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=[*configs, "--trainer.logger=false"])
    assert [type(callback) for callback in cli.trainer.callbacks if isinstance(callback, EarlyStopping)]
    assert not any(isinstance(callback, ModelCheckpoint) and callback.save_last for callback in cli.trainer.callbacks)


def test_callbacks_plus_adds_to_the_templates_and_the_run_keeps_its_last_checkpoint(run_cli, tmp_path):
    (tmp_path / "mine.yaml").write_text(f"trainer:\n  callbacks+:\n{EARLY_STOPPING}")
    cli = run_cli("fit", "-c", DDP_YAML, "-c", "mine.yaml", *RUN)
    kinds = [type(callback).__name__ for callback in cli.trainer.callbacks]
    assert set(TEMPLATE_CALLBACKS) | {"EarlyStopping"} <= set(kinds), kinds
    assert (tmp_path / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt").is_file()


def test_turn_off_leaves_out_the_entries_it_names_and_excuses_a_later_list_without_them(run_cli, tmp_path):
    template = yaml.safe_load(open(DDP_YAML).read())["trainer"]["callbacks"]  # noqa: SIM115
    # A copy of the template's list without StepTime, as a user edits it: accepted once turn_off names StepTime.
    mine = {"turn_off": ["StepTime"], "trainer": {"callbacks": [e for e in template if "StepTime" not in str(e)]}}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(mine))
    cli = run_cli("fit", "-c", DDP_YAML, "-c", "mine.yaml", *RUN)
    assert not any(isinstance(callback, StepTime) for callback in cli.trainer.callbacks)
    assert any(isinstance(callback, LastCheckpoint) for callback in cli.trainer.callbacks)
    # On the command line, over the template's own list: only the names given go.
    cli = run_cli("fit", "-c", DDP_YAML, "--turn_off=[StepTime,lightning.pytorch.callbacks.ModelCheckpoint]", *RUN)
    kinds = {type(callback).__name__ for callback in cli.trainer.callbacks if isinstance(callback, Callback)}
    assert set(TEMPLATE_CALLBACKS) - kinds == {"StepTime", "ModelCheckpoint"}
    record = yaml.safe_load((tmp_path / "logs" / "toy" / "default" / "config.yaml").read_text())
    assert "StepTime" not in str(record["trainer"]["callbacks"]) and record["turn_off"][0] == "StepTime"


def test_a_turn_off_name_no_list_gives_is_refused_naming_those_it_could_be(run_cli, capsys):
    assert refused(run_cli, capsys, "--turn_off=[StepTim]", *RUN) == (
        "error: turn_off names StepTim, which is not among the run's callbacks and plugins: "
        f"{', '.join(sorted([*TEMPLATE_CALLBACKS, 'AtomicCheckpointIO']))}. Name an entry by its class name, such as "
        "StepTime."
    )
