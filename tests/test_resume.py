"""What a resumed run checks and says: the checkpoint must fit the model, and the code digest nodes compare."""

import importlib

import pytest
import torch.distributed as dist

from tests.helpers import DDP_YAML
from training.fingerprint import code_digest, imported_code


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
    saved = (tmp_path / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt").read_bytes()
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
    assert (tmp_path / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt").read_bytes() == saved


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
