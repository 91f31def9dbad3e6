"""The zoo's modules that bring their own optimization, each run as a user would: 2-process jobs of
``cli.py -c configs/ddp.yaml --model ... --data ...`` (fit, the same command again, validate, predict), set beside
plain LightningCLI on the same module. The same command again and validate run in one process: that nothing is
trained, and which weights are used, a second process would not change.

- tests.zoo.GAN (manual optimization, two optimizers, a network without gradient in each backward pass): without
  configs/find_unused.yaml it stops in one paragraph naming the parameters; with it, it trains, resumes from a
  shorter run to the very parameters of an uninterrupted one, and predicts. Plain LightningCLI needs no
  find_unused (one process, no DDP); it gives the same predictions from the template's checkpoint. Stopped by
  SIGTERM after its first batch, it saves both optimizers and the same command continues to the same step count.
  Like a training-only module, it has no validation at all (its on_validation_epoch_end, as in Lightning's example,
  never runs): it keeps last.ckpt alone, with no warning about the best checkpoint's metric, and validate is
  refused as plain LightningCLI refuses it, in one paragraph instead of a traceback.
- tests.zoo.PartialOptimizerModule (a network, a partial optimizer and scheduler passed in, hydra style): it trains
  with its own default optimizer and the scheduler of its config, keeps its data module's batch size, and its
  checkpoints move both ways between the template and plain LightningCLI.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from tests.helpers import (
    DDP_YAML,
    REPO,
    SINGLE_PROCESS,
    cli_job,
    finish,
    job_output,
    plain_lightning_cli,
    plain_predictions,
    probe_args,
    probe_records,
    succeeded,
    wait_for_hold,
)
from training.checkpoints.contents import counters

FIND_UNUSED_YAML = str(REPO / "configs" / "find_unused.yaml")
GAN = ["--model", "tests.zoo.GAN", "--data", "tests.zoo.Samples"]
BATCHES_PER_EPOCH = 4  # tests.zoo.Samples and Blobs: 64 samples, 8 per batch, 2 processes


@pytest.fixture(scope="module")
def gan(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gan")
    fit = ["fit", "-c", DDP_YAML, "-c", FIND_UNUSED_YAML, *GAN]
    return {
        "workdir": workdir,
        "unchecked": cli_job(workdir, "unchecked", "fit", "-c", DDP_YAML, *GAN),
        "first": cli_job(workdir, "resumed", *fit, "--trainer.max_epochs=1"),
        "resumed": cli_job(workdir, "resumed", *fit, "--trainer.max_epochs=2", *probe_args(workdir / "probe-resumed")),
        "whole": cli_job(workdir, "whole", *fit, "--trainer.max_epochs=2", *probe_args(workdir / "probe-whole")),
        "again": cli_job(workdir, "whole", *fit, "--trainer.max_epochs=2", *SINGLE_PROCESS),
        "predict": cli_job(workdir, "whole", "predict", "-c", DDP_YAML, *GAN),
        "validate": cli_job(workdir, "whole", "validate", "-c", DDP_YAML, *GAN),
        **preempted(workdir, *fit, "--trainer.max_epochs=2", "--data.init_args.num_samples=640"),
    }


def preempted(workdir: Path, *fit: str) -> dict:
    """The run ``preempted``, on ten times the samples: sent SIGTERM while its ranks hold after their first batch
    (two optimizer steps), which they agree on a few batches later; its last.ckpt then, and the same command again."""
    hold = workdir / "sigterm.hold"
    hold.touch()
    holding = [
        "--trainer.callbacks+=tests.helpers.probe.HoldAtStep",
        "--trainer.callbacks.step=2",
        f"--trainer.callbacks.hold_file={hold}",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RUN_ID": "preempted"}
    command = [sys.executable, str(REPO / "cli.py"), *fit, *holding]
    process = subprocess.Popen(
        command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for_hold(hold, 2, process)
    process.send_signal(signal.SIGTERM)
    stopped = finish(process)
    saved = torch.load(workdir / "logs" / "gan" / "preempted" / "checkpoints" / "last.ckpt", weights_only=True)
    return {"stopped": stopped, "stopped_checkpoint": saved, "continued": cli_job(workdir, "preempted", *fit)}


def gan_checkpoint(gan: dict, run_id: str) -> dict:
    return torch.load(gan["workdir"] / "logs" / "gan" / run_id / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.mark.distributed
def test_a_gan_without_find_unused_stops_in_one_paragraph_naming_the_parameters_and_the_config(gan):
    result = gan["unchecked"]
    assert result.returncode == 1, job_output(result)
    assert "Traceback" not in job_output(result)
    paragraphs = re.findall(r"^error: (.*)$", job_output(result), re.MULTILINE)
    assert len(paragraphs) == 1, job_output(result)
    # toggle_optimizer turns the discriminator's requires_grad off for the generator's backward pass.
    named = re.search(r"first training step[^:]*: (.*?)\. DDP", paragraphs[0]).group(1).split(", ")
    assert named == [f"discriminator.{name}" for name in ("0.weight", "0.bias", "2.weight", "2.bias")]
    assert "manual_backward" in paragraphs[0]
    assert "-c configs/find_unused.yaml" in paragraphs[0]
    assert not list((gan["workdir"] / "logs" / "gan" / "unchecked").rglob("*.ckpt"))


@pytest.mark.distributed
def test_a_gan_trains_with_find_unused_counting_a_step_per_optimizer_step(gan):
    succeeded(gan["whole"])
    checkpoint = gan_checkpoint(gan, "whole")
    assert len(checkpoint["optimizer_states"]) == 2
    batches = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"]
    assert checkpoint["global_step"] == 2 * batches  # global_step counts optimizer steps: two per batch
    first, second = (record["params"] for record in probe_records(gan["workdir"] / "probe-whole", 2))
    for name, value in first.items():
        assert torch.equal(value, second[name]), name


@pytest.mark.distributed
def test_a_gan_without_validation_trains_and_keeps_last_ckpt_only(gan):
    output = succeeded(gan["whole"])
    # The best checkpoint's callback steps aside once, rather than warn at every epoch's end.
    assert "could not find the monitored key" not in output
    assert output.count("The model has no validation (no validation_step, no val dataloader") == 1
    checkpoints = gan["workdir"] / "logs" / "gan" / "whole" / "checkpoints"
    assert [path.name for path in checkpoints.iterdir()] == ["last.ckpt"]
    last = torch.load(checkpoints / "last.ckpt", weights_only=True)
    batches = last["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"]
    assert counters(checkpoints / "last.ckpt") == (2, 2 * batches)  # two optimizer steps per batch


@pytest.mark.distributed
def test_validate_without_validation_data_is_refused_in_one_paragraph_as_plain_lightning_cli_refuses_it(gan):
    result = gan["validate"]
    assert result.returncode == 1, job_output(result)
    assert "Traceback" not in job_output(result), job_output(result)
    (paragraph,) = re.findall(r"^error: (.*)$", job_output(result), re.MULTILINE)
    assert "to run `Trainer.validate`" in paragraph
    plain = plain_lightning_cli(*GAN)
    with pytest.raises(MisconfigurationException, match=re.escape(paragraph)):
        plain.trainer.validate(plain.model, datamodule=plain.datamodule)


@pytest.mark.distributed
def test_the_gan_data_module_keeps_its_own_batch_size(gan):
    succeeded(gan["whole"])
    assert gan_checkpoint(gan, "whole")["global_step"] == 2 * 2 * BATCHES_PER_EPOCH  # 2 epochs, 2 optimizers


@pytest.mark.distributed
def test_a_gan_resumed_after_fewer_epochs_ends_with_the_parameters_of_an_uninterrupted_run(gan):
    succeeded(gan["first"])
    resumed = succeeded(gan["resumed"])
    step = gan_checkpoint(gan, "whole")["global_step"] // 2
    assert re.search(rf"Resuming from \S+/logs/gan/resumed/checkpoints/last\.ckpt \(epoch \d, step {step}\)", resumed)
    resumed_ranks = probe_records(gan["workdir"] / "probe-resumed", 2)
    whole_ranks = probe_records(gan["workdir"] / "probe-whole", 2)
    for resumed_rank, whole_rank in zip(resumed_ranks, whole_ranks, strict=True):
        for name, value in whole_rank["params"].items():
            assert torch.equal(resumed_rank["params"][name], value), name
    whole, interrupted = gan_checkpoint(gan, "whole"), gan_checkpoint(gan, "resumed")
    for saved, reference in zip(interrupted["optimizer_states"], whole["optimizer_states"], strict=True):
        for index, state in reference["state"].items():
            assert torch.equal(saved["state"][index]["exp_avg"], state["exp_avg"])


@pytest.mark.distributed
def test_the_same_gan_command_again_trains_nothing_and_says_so(gan):
    succeeded(gan["whole"])
    again = succeeded(gan["again"])
    assert "Nothing to train: the run in logs/gan/whole already reached its end" in again


@pytest.mark.distributed
def test_a_gan_predicts_through_the_template_what_plain_lightning_cli_predicts(gan):
    predicted = succeeded(gan["predict"])
    assert re.search(r"Predicting with the weights of \S+/logs/gan/whole/checkpoints/last\.ckpt", predicted)
    written = torch.load(gan["workdir"] / "logs" / "gan" / "whole" / "predictions.pt")
    assert written.shape == (24, 8)  # tests.zoo.Samples: 24 latent vectors, samples of 8 numbers
    checkpoint = gan["workdir"] / "logs" / "gan" / "whole" / "checkpoints" / "last.ckpt"
    torch.testing.assert_close(written, plain_predictions(checkpoint, *GAN))


@pytest.mark.distributed
def test_a_gan_stopped_by_sigterm_saves_both_optimizers_mid_epoch_and_the_same_command_continues(gan):
    stop = r"Stopped by a signal \(SIGTERM\) at epoch 0, step (\d+): saved logs/gan/preempted/checkpoints/last\.ckpt"
    step = int(re.search(stop, gan["stopped"]).group(1))
    saved = gan["stopped_checkpoint"]
    assert saved["global_step"] == step >= 2
    for optimizer in saved["optimizer_states"]:  # each took half the steps, for every parameter of its network
        assert [float(state["step"]) for state in optimizer["state"].values()] == [step / 2] * 4
    continued = succeeded(gan["continued"])
    assert re.search(rf"Resuming from \S+/preempted/checkpoints/last\.ckpt \(epoch 0, step {step}\)", continued)
    final = gan_checkpoint(gan, "preempted")
    batches = final["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"]
    assert final["global_step"] == 2 * batches > step
    assert counters(gan["workdir"] / "logs" / "gan" / "preempted" / "checkpoints" / "last.ckpt")[0] == 2


HYDRA_STYLE = """\
model:
  class_path: tests.zoo.PartialOptimizerModule
  init_args:
    net:
      class_path: tests.zoo.Classifier
    scheduler:
      class_path: torch.optim.lr_scheduler.StepLR
      init_args:
        step_size: 1
        gamma: 0.5
data:
  class_path: tests.zoo.Blobs
"""


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("partial")
    config = workdir / "hydra_style.yaml"
    config.write_text(HYDRA_STYLE)
    configs = ["-c", DDP_YAML, "-c", str(config)]
    # The other way: a checkpoint of plain LightningCLI, which the template's predict must take.
    plain = plain_lightning_cli("-c", str(config), "--trainer.max_epochs=1", f"--trainer.default_root_dir={workdir}")
    plain.trainer.fit(plain.model, datamodule=plain.datamodule)
    plain_checkpoint = plain.trainer.checkpoint_callback.best_model_path
    return {
        "workdir": workdir,
        "config": config,
        "fit": cli_job(workdir, "hydra", "fit", *configs, "--trainer.max_epochs=2"),
        "again": cli_job(workdir, "hydra", "fit", *configs, "--trainer.max_epochs=2", *SINGLE_PROCESS),
        "validate": cli_job(workdir, "hydra", "validate", *configs, *SINGLE_PROCESS),
        "predict": cli_job(workdir, "hydra", "predict", *configs),
        "plain_checkpoint": plain_checkpoint,
        "from_plain": cli_job(workdir, "from_plain", "predict", *configs, f"--ckpt_path={plain_checkpoint}"),
    }


def partial_run(partial: dict) -> Path:
    return partial["workdir"] / "logs" / "partial_optimizer_module" / "hydra"


@pytest.mark.distributed
def test_a_partial_optimizer_module_trains_with_its_own_optimizer_and_the_scheduler_of_its_config(partial):
    succeeded(partial["fit"])
    checkpoint = torch.load(partial_run(partial) / "checkpoints" / "last.ckpt", weights_only=True)
    (group,) = checkpoint["optimizer_states"][0]["param_groups"]
    # Its own default, torch.optim.SGD (lr 0.001): not the toy's AdamW of configs/ddp.yaml.
    assert "momentum" in group and "betas" not in group, group
    assert group["initial_lr"] == 0.001
    (scheduler,) = checkpoint["lr_schedulers"]
    assert (scheduler["step_size"], scheduler["gamma"], scheduler["last_epoch"]) == (1, 0.5, 2)
    assert group["lr"] == pytest.approx(0.001 * 0.5**2)


@pytest.mark.distributed
def test_a_partial_optimizer_module_keeps_its_data_modules_own_batch_size(partial):
    succeeded(partial["fit"])
    checkpoint = torch.load(partial_run(partial) / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2 * BATCHES_PER_EPOCH


@pytest.mark.distributed
def test_the_same_command_again_trains_nothing_and_validate_uses_the_last_weights(partial):
    succeeded(partial["fit"])
    assert "Nothing to train: the run in logs/partial_optimizer_module/hydra already reached" in succeeded(
        partial["again"]
    )
    checkpoint = torch.load(partial_run(partial) / "checkpoints" / "last.ckpt", weights_only=True)
    last = rf"\S+/hydra/checkpoints/last\.ckpt \(epoch \d+, step {checkpoint['global_step']}\)"
    assert re.search(f"Validating with the weights of {last}", succeeded(partial["validate"]))
    assert re.search(r"val/acc\s+[01]\.\d+", job_output(partial["validate"])), job_output(partial["validate"])


@pytest.mark.distributed
def test_checkpoints_move_both_ways_between_the_template_and_plain_lightning_cli(partial):
    assert re.search(
        r"Predicting with the weights of \S+/logs/partial_optimizer_module/hydra/checkpoints/last\.ckpt",
        succeeded(partial["predict"]),
    )
    written = torch.load(partial_run(partial) / "predictions.pt")
    plain_args = ("-c", str(partial["config"]))
    torch.testing.assert_close(
        written, plain_predictions(partial_run(partial) / "checkpoints" / "last.ckpt", *plain_args)
    )

    succeeded(partial["from_plain"])
    from_plain = torch.load(partial["workdir"] / "logs" / "partial_optimizer_module" / "from_plain" / "predictions.pt")
    torch.testing.assert_close(from_plain, plain_predictions(Path(partial["plain_checkpoint"]), *plain_args))
    assert len(from_plain) == 32  # tests.zoo.Blobs: 32 held-out points, each once, in order
