"""A transformers GPT-2 (tests.zoo_transformers.TinyGPT) run as a user would: 2-process jobs of
``cli.py -c configs/ddp.yaml --model ... --data ...``. Stopped by SIGTERM after two steps, it saves the model, AdamW
and transformers' per-step schedule, and the same command trains on to the end; validate takes the run's weights;
test on 2 processes reports the loss of one process (11 sequences, each once); predict predicts what plain
LightningCLI predicts from the same checkpoint."""

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from tests.helpers import (
    DDP_YAML,
    REPO,
    SINGLE_PROCESS,
    finish,
    plain_predictions,
    run_script,
    succeeded,
    transformers_path,
    wait_for_hold,
)

pytestmark = pytest.mark.distributed

GPT = ["--model", "tests.zoo_transformers.TinyGPT", "--data", "tests.zoo_transformers.Counting"]
STEPS = 8  # 2 epochs of 64 sequences in batches of 8 on 2 processes


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gpt")
    aside = transformers_path()
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), aside]), "RUN_ID": "gpt"}

    def job(*args: str) -> str:
        return succeeded(run_script([str(REPO / "cli.py"), *args, *GPT], cwd=workdir, env=env))

    fit = ["fit", "-c", DDP_YAML, "--trainer.max_epochs=2"]
    hold = workdir / "sigterm.hold"
    hold.touch()
    holding = ["--trainer.callbacks+=tests.helpers.probe.HoldAtStep", "--trainer.callbacks.step=2"]
    command = [sys.executable, str(REPO / "cli.py"), *fit, *GPT, *holding, f"--trainer.callbacks.hold_file={hold}"]
    process = subprocess.Popen(
        command, cwd=workdir, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_for_hold(hold, 2, process)
    process.send_signal(signal.SIGTERM)
    found = {"stopped": finish(process)}
    checkpoint = workdir / "logs" / "tiny_gpt" / "gpt" / "checkpoints" / "last.ckpt"
    found["stopped_checkpoint"] = torch.load(checkpoint, weights_only=True)
    found["continued"] = job(*fit)
    found["checkpoint"] = torch.load(checkpoint, weights_only=True)
    found["validate"] = job("validate", "-c", DDP_YAML, *SINGLE_PROCESS)
    found["test"] = job("test", "-c", DDP_YAML)
    found["test_alone"] = job("test", "-c", DDP_YAML, *SINGLE_PROCESS)
    found["predict"] = job("predict", "-c", DDP_YAML)
    found["predictions"] = torch.load(workdir / "logs" / "tiny_gpt" / "gpt" / "predictions.pt")
    with pytest.MonkeyPatch.context() as patch:  # this worker imports transformers for plain LightningCLI
        patch.syspath_prepend(aside)
        found["plain_predictions"] = plain_predictions(checkpoint, *GPT)
    return found


def test_a_gpt_stopped_by_sigterm_saves_its_optimizer_and_schedule_and_the_same_command_trains_to_the_end(gpt):
    stop = r"Stopped by a signal \(SIGTERM\) at epoch 0, step (\d+): saved logs/tiny_gpt/gpt/checkpoints/last\.ckpt"
    step = int(re.search(stop, gpt["stopped"])[1])
    saved = gpt["stopped_checkpoint"]
    assert saved["global_step"] == step >= 2
    assert saved["lr_schedulers"][0]["last_epoch"] == step  # stepped once a step, from transformers
    assert {float(state["step"]) for state in saved["optimizer_states"][0]["state"].values()} == {step}
    assert re.search(rf"Resuming from \S+/gpt/checkpoints/last\.ckpt \(epoch 0, step {step}\)", gpt["continued"])
    final = gpt["checkpoint"]
    assert (final["global_step"], final["lr_schedulers"][0]["last_epoch"]) == (STEPS, STEPS)
    assert final["lr_schedulers"][0]["_last_lr"] == [0.0, 0.0], "the linear schedule did not end at the run's end"


def test_validate_takes_the_runs_weights(gpt):
    assert re.search(r"Validating with the weights of \S+/logs/tiny_gpt/gpt/checkpoints/last\.ckpt", gpt["validate"])
    assert re.search(r"val/loss\s+\d", gpt["validate"]), gpt["validate"]


def test_a_test_on_2_processes_reports_the_loss_of_one(gpt):
    # 11 sequences in batches of 4: shares of 6 and 5, two batches each; plain Lightning would test 12.
    losses = [float(re.search(r"test/loss\s+([\d.]+)", gpt[run])[1]) for run in ("test", "test_alone")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_a_gpt_predicts_through_the_template_what_plain_lightning_cli_predicts(gpt):
    assert gpt["predictions"].shape == (10,)
    torch.testing.assert_close(gpt["predictions"], gpt["plain_predictions"])
