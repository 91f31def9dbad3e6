"""A loss that becomes NaN or inf stops the run in one paragraph, and no checkpoint holds what came after; with
``non_finite: skip`` the bad steps are left out instead. Plain LightningCLI trains on, and its last.ckpt holds NaN."""

import re

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.helpers import DDP_YAML, SINGLE_PROCESS, cli_job, job_output, plain_lightning_cli
from tests.helpers.one_node import last_paragraph

EXPLODING = ["--model=tests.zoo.ExplodingClassifier", "--data=tests.zoo.Blobs", "--monitor=val_loss"]
FIT = ["fit", "-c", DDP_YAML, *EXPLODING, "--trainer.max_epochs=4", "--trainer.log_every_n_steps=2"]
FIXES = (
    "Try a lower learning rate, gradient clipping (--trainer.gradient_clip_val=1.0), bf16 in place of fp16, or look "
    "for bad values in the data of that step; to leave such steps out instead, set non_finite: skip on the "
    "training.FiniteLoss entry of trainer.callbacks."
)


def finite(checkpoint: dict) -> bool:
    return all(torch.isfinite(tensor).all() for tensor in checkpoint["state_dict"].values())


@pytest.fixture(scope="module")
def exploded(tmp_path_factory):
    """Two processes train tests.zoo.ExplodingClassifier until its loss is NaN; then the same command again."""
    workdir = tmp_path_factory.mktemp("exploded")
    checkpoints = workdir / "logs" / "exploding_classifier" / "nan" / "checkpoints"
    first = cli_job(workdir, "nan", *FIT)
    saved = {path.name: torch.load(path, weights_only=True) for path in checkpoints.glob("*.ckpt")}
    again = cli_job(workdir, "nan", *FIT)
    return {"first": first, "saved": saved, "again": again, "checkpoints": checkpoints}


@pytest.mark.distributed
def test_a_non_finite_loss_stops_every_process_in_one_paragraph_naming_the_step_and_the_checkpoint(exploded):
    result = exploded["first"]
    assert result.returncode == 1, job_output(result)
    paragraph = last_paragraph(job_output(result))
    last = exploded["saved"]["last.ckpt"]
    found = re.fullmatch(
        r"error: the loss became NaN or inf at step (\d+), on ranks 0, 1, so the run stopped: no checkpoint holds "
        r"what came after\. (\S+), written at step (\d+), holds the last finite weights: the same command resumes "
        r"from it\. (.*)",
        paragraph,
    )
    assert found and found[2] == "logs/exploding_classifier/nan/checkpoints/last.ckpt", paragraph
    assert int(found[3]) == last["global_step"] < int(found[1]) and found[4] == FIXES
    assert job_output(result).count("error: ") == 1


@pytest.mark.distributed
def test_every_checkpoint_left_is_finite_and_the_same_command_resumes_from_the_last_finite_one(exploded):
    assert "last.ckpt" in exploded["saved"] and len(exploded["saved"]) == 2
    assert all(finite(checkpoint) for checkpoint in exploded["saved"].values())
    again = exploded["again"]
    assert again.returncode == 1, job_output(again)
    step = exploded["saved"]["last.ckpt"]["global_step"]
    epoch = exploded["saved"]["last.ckpt"]["epoch"]
    assert f"Resuming from {exploded['checkpoints'] / 'last.ckpt'} (epoch {epoch}, step {step})" in job_output(again)
    # The same learning rate explodes again: still nothing non-finite saved, last.ckpt where it was.
    assert "which this attempt resumed from, is finite" in last_paragraph(job_output(again))
    last = torch.load(exploded["checkpoints"] / "last.ckpt", weights_only=True)
    assert last["global_step"] == step and finite(last)


def test_with_non_finite_skip_the_bad_steps_are_left_out_and_the_run_ends_with_finite_weights(run_cli, tmp_path):
    callbacks = yaml.safe_load(open(DDP_YAML).read())["trainer"]["callbacks"]  # noqa: SIM115
    for entry in callbacks:
        if entry["class_path"] == "training.FiniteLoss":
            entry["init_args"]["non_finite"] = "skip"
    (tmp_path / "skip.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    with pytest.warns(UserWarning, match=r"the gradients held NaN or inf, so the optimizer step was left out"):
        cli = run_cli("fit", "-c", DDP_YAML, "-c", "skip.yaml", *EXPLODING, *SINGLE_PROCESS, "--trainer.max_epochs=4")
    assert cli.trainer.global_step == 4 * 8  # Blobs: 64 points, 8 a batch
    last = torch.load(tmp_path / "logs" / "exploding_classifier" / "default" / "checkpoints" / "last.ckpt")
    assert last["global_step"] == 32 and finite(last)
    assert all(torch.isfinite(parameter).all() for parameter in cli.model.parameters())


def test_plain_lightning_cli_trains_on_and_saves_nan_weights_as_its_last_checkpoint(tmp_path):
    cli = plain_lightning_cli(
        "--model=tests.zoo.ExplodingClassifier",
        "--data=tests.zoo.Blobs",
        "--trainer.max_epochs=4",
        f"--trainer.default_root_dir={tmp_path}",  # its own checkpoints too, not in the working directory
    )
    cli.trainer.callbacks.append(ModelCheckpoint(dirpath=tmp_path, save_last=True))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert not finite(torch.load(tmp_path / "last.ckpt", weights_only=True))


def test_the_check_names_the_first_non_finite_step_of_the_losses_held_and_comes_at_least_every_most_held_batches(
    monkeypatch,
):
    from types import SimpleNamespace

    from training.callbacks import finite_loss

    monkeypatch.setattr(finite_loss, "MOST_HELD", 5)
    callback = finite_loss.FiniteLoss()
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=1000, world_size=1, global_rank=0, ckpt_path=None)
    trainer.callbacks = []
    trainer.checkpoint_callback = None
    module = SimpleNamespace(device=torch.device("cpu"), parameters=list)
    callback.on_train_start(trainer, module)
    losses = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, float("nan"), 8.0, float("inf"), 10.0]
    with pytest.raises(finite_loss.NonFiniteError, match=r"^the loss became NaN or inf at step 16, on rank 0, "):
        for batch_idx, loss in enumerate(losses):
            trainer.global_step = 10 + batch_idx
            callback.on_train_batch_end(trainer, module, {"loss": torch.tensor(loss)}, None, batch_idx)
            assert len(callback.held) < 5
            assert batch_idx < 9, "the fifth loss held since the check at step 14 brings the next check"
    assert finite_loss.first_non_finite([torch.tensor([1.0, 2.0]), torch.tensor([3.0, float("inf")])]) == 1
    assert finite_loss.first_non_finite([torch.tensor(1.0)]) == 1 and finite_loss.first_non_finite([]) == 0
