"""What a resumed run checks and says: the checkpoint must fit the model and lie within the configured end, the
run's config record describes the training that wrote last.ckpt, and the code digest nodes compare."""

import importlib
import importlib.util
import re
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml

from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS
from training.checkpoints.agreement import given_settings_problem, loads_problem
from training.checkpoints.contents import counters, size_text, unloadable
from training.checkpoints.resume import checkpoint_problem, start_problem
from training.job.fingerprint import code_digest, imported_code


@pytest.fixture
def one_process_group():
    """The template's DDPStrategy with one device starts a process group in this pytest process: end it after."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_checkpoint_of_another_model_stops_the_run_naming_the_difference(
    run_cli, capsys, tmp_path, one_process_group
):
    # The check is the template's DDPStrategy's, which runs here as one process.
    args = ["fit", "-c", DDP_YAML, "--trainer.devices=1", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2"]
    run_cli(*args, "--model.init_args.hidden_features=16")
    run = tmp_path / "logs" / "toy" / "default"
    saved = (run / "checkpoints" / "last.ckpt").read_bytes()
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    capsys.readouterr()
    try:
        run_cli(*args, "--model.init_args.hidden_features=32")
    except SystemExit as exit_:
        assert exit_.code == 1
    else:
        raise AssertionError("the run trained from a checkpoint of another model")
    err = capsys.readouterr().err
    assert (
        "holds another model than the config builds now (other shape: net.0.bias (16,) in the checkpoint, (32,) now"
        in err
    )
    assert "start a new run with RUN_ID=<new id>" in err
    assert "Traceback" not in err
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == saved
    after = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    assert after == files, "the failed attempt left files in the run's directory"


@pytest.mark.parametrize("compiled_in", ["fit", "validate"])
def test_a_checkpoint_of_the_compiled_module_loads_into_it_uncompiled_and_back(
    run_cli, capsys, tmp_path, one_process_group, compiled_in
):
    # torch.compile's eager backend: the same wrapper and keys as inductor's, without compiling C++ here.
    compiled = ["--model.init_args.compile_backend=eager"]
    args = ["-c", DDP_YAML, "--model=tests.zoo.MaybeCompiled", "--trainer.devices=1", "--trainer.limit_val_batches=2"]
    run_cli(
        "fit", *args, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", *compiled * (compiled_in == "fit")
    )
    checkpoint = torch.load(tmp_path / "logs" / "maybe_compiled" / "default" / "checkpoints" / "last.ckpt")
    assert any("_orig_mod." in key for key in checkpoint["state_dict"]) == (compiled_in == "fit")
    capsys.readouterr()
    validate = run_cli("validate", *args, *compiled * (compiled_in == "validate"))
    assert "holds another model" not in capsys.readouterr().err
    trained = {key.replace("_orig_mod.", ""): value for key, value in checkpoint["state_dict"].items()}
    loaded = {key.replace("_orig_mod.", ""): value for key, value in validate.model.state_dict().items()}
    assert trained.keys() == loaded.keys() and all(torch.equal(trained[k], loaded[k]) for k in trained)
    assert torch.isfinite(validate.trainer.callback_metrics["val/loss"]), "validate evaluated nothing"


def test_a_checkpoint_holding_a_numpy_array_is_named_with_the_type_and_the_fixes_and_resumes_as_told(
    run_cli, capsys, tmp_path
):
    args = [
        "fit",
        "-c",
        DDP_YAML,
        *SINGLE_PROCESS,
        "--model=tests.zoo.NumpyStatistics",
        "--trainer.limit_val_batches=1",
    ]
    args += ["--trainer.limit_train_batches=2"]
    with pytest.warns(UserWarning) as warned:  # at the first save, in the background writer's thread
        run_cli(*args, "--trainer.max_epochs=1")
    last = tmp_path / "logs" / "numpy_statistics" / "default" / "checkpoints" / "last.ckpt"
    (told,) = [str(warning.message) for warning in warned if "the checkpoint just saved" in str(warning.message)]
    assert re.fullmatch(
        rf"the checkpoint just saved, {tmp_path}/logs/numpy_statistics/default/checkpoints/\S+\.ckpt, holds an object "
        r"of type numpy\.ndarray under checkpoint\['target_mean'\] \(pickled as "
        r"numpy\._core\.multiarray\._reconstruct\), which the run cannot load back the way it loads checkpoints, "
        r"torch\.load\(weights_only=True\) .* or set weights_only: false, which unpickles whatever a file holds\.",
        told,
    ), told
    saved = last.read_bytes()
    capsys.readouterr()
    err = fails(run_cli, capsys, *args, "--trainer.max_epochs=2")
    paragraph = err.strip().splitlines()[-1]
    assert paragraph.startswith(
        f"error: {last} ({size_text(len(saved))}) holds an object of type numpy._core.multiarray._reconstruct, which "
        "the run cannot load the way it loads checkpoints, torch.load(weights_only=True) (the config's weights_only; "
        "torch: Unsupported global: GLOBAL numpy._core.multiarray._reconstruct was not an allowed global by default."
    )
    assert "torch.serialization.add_safe_globals([numpy._core.multiarray._reconstruct])" in paragraph
    assert "--weights_only=false" in paragraph and "\x1b" not in err and "Give another checkpoint" not in paragraph
    assert last.read_bytes() == saved
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        resumed = run_cli(*args, "--trainer.max_epochs=2", "--weights_only=false")  # the fix for a file one trusts
    assert resumed.trainer.global_step == 4
    assert not [warning for warning in after if "the checkpoint just saved" in str(warning.message)]


def test_the_first_save_check_names_only_an_object_weights_only_refuses(tmp_path, monkeypatch):
    plain = {"state_dict": {"w": torch.zeros(2)}, "epoch": 0, "hyper_parameters": {"lr": 0.1, "sizes": [8, 8]}}
    torch.save(plain, tmp_path / "plain.ckpt")
    assert unloadable(plain, tmp_path / "plain.ckpt") is None
    odd = {**plain, "callbacks": {"Scaler": {"mean": np.zeros(3)}}}
    torch.save(odd, tmp_path / "odd.ckpt")
    told = unloadable(odd, tmp_path / "odd.ckpt")
    assert "holds an object of type numpy.ndarray under checkpoint['callbacks']['Scaler']['mean']" in told, told
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: (_ for _ in ()).throw(OSError("no mmap here")))
    assert unloadable(odd, tmp_path / "odd.ckpt") is None  # a check that cannot run says nothing; saving goes on


def test_an_evaluation_of_another_models_checkpoint_speaks_of_evaluating_not_resuming():
    everyone = [("node 0 (a)", "last.ckpt", "missing: net.0.weight")]
    assert loads_problem(everyone, "last.ckpt", fitting=False) == (
        "the checkpoint last.ckpt holds another model than the config builds now (missing: net.0.weight). To evaluate "
        "it, restore the model settings of that run, or give --ckpt_path a checkpoint of the model the config builds "
        "now."
    )
    assert "To resume, restore the model settings" in loads_problem(everyone, "last.ckpt", fitting=True)


def test_a_checkpoint_file_of_another_model_than_the_one_given_is_refused_before_lightning_swaps_it_in(
    run_cli, capsys, tmp_path
):
    # LightningCLI builds the model a --ckpt_path file's hyperparameters describe, over the class and settings given.
    args = ["fit", "-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]
    run_cli(*args, "--trainer.max_epochs=1", "--model.init_args.hidden_features=16")
    checkpoint = str(tmp_path / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt")
    capsys.readouterr()
    other_class = ["--model", "models.AuxHeadModel"]
    err = fails(run_cli, capsys, *args, "--trainer.max_epochs=2", *other_class, "--ckpt_path", checkpoint)
    assert err.strip().splitlines()[-1] == (
        f"error: --ckpt_path {checkpoint} holds a models.ToyModel, and the config gives "
        "model.class_path=models.AuxHeadModel: LightningCLI would build the checkpoint's models.ToyModel and drop the "
        "model given. Give a checkpoint of models.AuxHeadModel, or --model models.ToyModel to use this one."
    )
    err = fails(run_cli, capsys, *args, "--model.init_args.hidden_features=64", "--ckpt_path", checkpoint)
    assert err.strip().splitlines()[-1] == (
        f"error: --ckpt_path {checkpoint} holds a model built with other settings than those given "
        "(model.init_args.hidden_features=64 is given, the checkpoint has 16): LightningCLI would build the model the "
        "checkpoint describes and drop the settings given. Leave them out to use the checkpoint's model; to train the "
        "changed model, start a new run with RUN_ID=<new id>."
    )
    assert not (tmp_path / "logs" / "aux_head").exists()
    same = {"class_path": "models.ToyModel", "init_args": {"hidden_features": 16}}
    assert given_settings_problem(checkpoint, lambda: same) is None
    assert given_settings_problem(checkpoint, lambda: {"class_path": "models.ToyModel"}) is None


def fails(run_cli, capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        run_cli(*args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_a_run_past_its_end_stops_before_training_and_its_record_stays(run_cli, capsys, caplog, tmp_path):
    fit = ["fit", "-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.limit_train_batches=4"]
    run_cli(*fit, "--trainer.max_epochs=2")
    run = tmp_path / "logs" / "toy" / "default"
    last = run / "checkpoints" / "last.ckpt"
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    capsys.readouterr()

    err = fails(run_cli, capsys, *fit, "--trainer.max_epochs=1")
    assert (
        f"the run in {run} is past the end this config sets: its checkpoint {last} was saved at epoch 1, step 8" in err
    )
    assert "beyond trainer.max_epochs=1. To continue this run, raise that limit" in err and "RUN_ID" in err
    err = fails(run_cli, capsys, *fit, "--trainer.max_epochs=-1", "--trainer.max_steps=5")
    assert "step 8 (2 epochs begun), beyond trainer.max_steps=5" in err
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    err = fails(run_cli, capsys, *fit, "--ckpt_path=notes.txt")
    assert f"{tmp_path / 'notes.txt'} (16 bytes) is not a checkpoint: a torch checkpoint is a zip archive" in err

    # Exactly at its end: harmless, so a scheduler may requeue a finished run.
    run_cli(*fit, "--trainer.max_epochs=2", "--seed_everything=7")
    assert f"Nothing to train: the run in {run.relative_to(tmp_path)} already reached its end" in caplog.text
    after = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    assert after == files, "an attempt that did not train changed the run's directory"

    run_cli(*fit, "--trainer.max_epochs=3")
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["max_epochs"] == 3
    (earlier,) = run.glob("config-*.yaml")
    assert earlier.read_bytes() == files[run / "config.yaml"], "the config of the first two epochs was not kept"


CUTS = {
    "half": (0.5, "is not a complete checkpoint: a torch checkpoint is a zip archive, and this one is cut short"),
    "90%": (0.9, "is not a complete checkpoint: a torch checkpoint is a zip archive, and this one is cut short"),
    "99%": (0.99, "is not a complete checkpoint: a torch checkpoint is a zip archive, and this one is cut short"),
    "empty": (0, "is empty: a save or a copy that wrote nothing"),
}


def test_a_damaged_checkpoint_is_named_with_its_size_and_what_it_lacks_and_the_run_stays(run_cli, capsys, tmp_path):
    args = ["-c", DDP_YAML, *SINGLE_PROCESS, "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]
    run_cli("fit", *args, "--trainer.max_epochs=1")
    run = tmp_path / "logs" / "toy" / "default"
    last = run / "checkpoints" / "last.ckpt"
    (best,) = (path for path in last.parent.glob("*.ckpt") if path != last)
    whole = last.read_bytes()
    cuts = {name: (whole[: int(len(whole) * fraction)], told) for name, (fraction, told) in CUTS.items()}
    cuts["text"] = (
        (REPO / "README.md").read_bytes(),
        "is not a checkpoint: a torch checkpoint is a zip archive, and this is a text file",
    )
    for name, (content, told) in cuts.items():
        last.write_bytes(content)
        files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
        # Every subcommand reads the checkpoint through the same check: one kind of damage is enough to show it.
        for subcommand in ("fit", "validate", "predict") if name == "half" else ("fit",):
            err = fails(run_cli, capsys, subcommand, *args, "--trainer.max_epochs=2")
            size = f"{len(content)} bytes" if len(content) < 1024 else f"{round(len(content) / 1024)} KB"
            assert f"error: {last} ({size}) {told}" in err, (name, subcommand, err)
            assert f"Nothing was changed. Give another checkpoint with --ckpt_path, such as {best}" in err, err
            assert "move it away to start the run over" in err
            assert "mmap" not in err and "miniz" not in err and "zipfile_serialization" not in err, err
            after = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
            assert after == files, (name, subcommand, "the failed attempt changed the run's directory")

    err = fails(run_cli, capsys, "test", *args, "--ckpt_path", str(REPO / "README.md"))
    assert f"error: {REPO / 'README.md'} (" in err and "is not a checkpoint: a torch checkpoint is a zip" in err
    assert "Give another checkpoint with --ckpt_path." in err and "move it away" not in err


def test_checkpoint_names_lightning_resolves_are_left_to_it_where_it_can(tmp_path, monkeypatch):
    for name in ("best", "hpc", "registry:my-model:latest"):
        assert start_problem(None, "fit", name, True) is None, name
    (tmp_path / "hpc_ckpt_3.ckpt").touch()
    assert checkpoint_problem("hpc", str(tmp_path)) is None
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "litmodels" else found(name))
    assert checkpoint_problem("registry:my-model:latest") is None


def test_a_checkpoint_name_lightning_cannot_resolve_here_says_what_to_give(run_cli, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no litmodels
    for name, told in [
        ("best", "Lightning resolves best to the best checkpoint of a fit that ran earlier in the same process"),
        ("hpc", f"Lightning loads the newest hpc_ckpt_N.ckpt of trainer.default_root_dir ({tmp_path}), and there"),
        ("registry:my-model", "Lightning loads a model registry checkpoint with the litmodels package, which is not"),
    ]:
        err = fails(run_cli, capsys, "predict", "-c", DDP_YAML, *SINGLE_PROCESS, "--ckpt_path", name)
        assert err.strip().splitlines()[-1].startswith(f"error: --ckpt_path {name}: {told}")
        assert "give a checkpoint's path" in err.lower(), err


def test_the_code_digest_covers_the_user_modules_a_run_imported(tmp_path, monkeypatch):
    package = tmp_path / "user_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text("WIDTH = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("user_package.model")
    try:
        assert imported_code()["user_package.model"] == package / "model.py"
        assert "torch" not in imported_code() and "json" not in imported_code(), "installed code has its own check"
        before = code_digest()
        (package / "unused.py").write_text("never imported\n")
        assert code_digest() == before, "a file the run did not import changed the digest"
        (package / "model.py").write_text("WIDTH = 2\n")
        assert code_digest() != before, "an edit to an imported user module left the digest as it was"
    finally:
        for name in ("user_package.model", "user_package"):
            monkeypatch.delitem(importlib.sys.modules, name)


def test_a_checkpoint_saved_as_training_ended_counts_the_epochs_it_trained(tmp_path):
    # ModelCheckpoint saves last.ckpt in on_train_end for a module that validates nothing: its epoch is the next one,
    # which never began. Lightning's loop counts the epochs begun; epoch + 1 holds only for a save within an epoch.
    progress = {"current": {"ready": 2, "started": 2, "processed": 2, "completed": 2}}
    ended = {"epoch": 2, "global_step": 8, "loops": {"fit_loop": {"epoch_progress": progress}}}
    torch.save(ended, tmp_path / "last.ckpt")
    assert counters(tmp_path / "last.ckpt") == (2, 8)
    torch.save({"epoch": 1, "global_step": 8}, tmp_path / "old.ckpt")  # no loop state: a save at an epoch's end
    assert counters(tmp_path / "old.ckpt") == (2, 8)
