"""The GPU tier (``python -m pytest -m gpu``): the main config, mixed precision and the seq2seq example on CUDA.

Each test is skipped with the reason on a machine with fewer GPUs than it needs. The doctor's, the benchmark's
and FSDP's GPU tests live beside their CPU tests (tests/test_doctor.py, test_bench.py, test_fsdp.py).
"""

import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import DDP_YAML, REPO, needs_gpus, probe_args, probe_records, run_script

CLI = str(REPO / "cli.py")
SEQ2SEQ_YAML = str(REPO / "configs" / "seq2seq.yaml")
# Bitwise repeatable on a GPU: Lightning's deterministic mode turns on torch's deterministic algorithms and sets
# CUBLAS_WORKSPACE_CONFIG=:4096:8 (cuBLAS's condition for repeatable results); the seed comes from the config.
DETERMINISTIC = "--trainer.deterministic=true"


def fit(workdir, run_id: str, *args: str) -> str:
    """``python cli.py fit -c configs/ddp.yaml ARGS`` in ``workdir`` as the run ``run_id``; its output."""
    probe = probe_args(workdir / "probe" / run_id)
    result = run_script([CLI, "fit", "-c", DDP_YAML, *args, *probe], cwd=workdir, env={"RUN_ID": run_id})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def train_losses(workdir, name: str, run_id: str) -> list[float]:
    events = EventAccumulator(str(workdir / "logs" / name / run_id))
    events.Reload()
    return [event.value for event in events.Scalars("train/loss")]


@pytest.fixture(scope="module")
def main_config_runs(tmp_path_factory):
    """The main config as a user starts it, over 2 epochs; and the same run stopped after epoch 1 and resumed."""
    workdir = tmp_path_factory.mktemp("gpu")
    whole = fit(workdir, "whole", "--trainer.max_epochs=2", DETERMINISTIC)
    fit(workdir, "split", "--trainer.max_epochs=1", DETERMINISTIC)
    resumed = fit(workdir, "split", "--trainer.max_epochs=2", DETERMINISTIC)
    return workdir, whole, resumed


@needs_gpus(1)
def test_the_main_config_trains_on_every_gpu_with_nccl_and_checkpoints(main_config_runs):
    workdir, output, _ = main_config_runs
    assert "GPU available: True (cuda), used: True" in output
    gpus = torch.cuda.device_count()
    records = probe_records(workdir / "probe" / "whole", gpus)
    assert [(r["world_size"], r["backend"], r["device"]) for r in records] == [
        (gpus, "nccl", f"cuda:{rank}") for rank in range(gpus)
    ]
    checkpoint = torch.load(workdir / "logs" / "toy" / "whole" / "checkpoints" / "last.ckpt", map_location="cpu")
    assert checkpoint["epoch"] == 1 and checkpoint["global_step"] > 0
    losses = train_losses(workdir, "toy", "whole")
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


@needs_gpus(1)
def test_the_resumed_run_ends_with_the_weights_of_the_uninterrupted_one_bit_for_bit(main_config_runs):
    workdir, _, resumed = main_config_runs
    assert "Restored all states from the checkpoint" in resumed
    gpus = torch.cuda.device_count()
    whole, split = (probe_records(workdir / "probe" / run, gpus)[0]["params"] for run in ("whole", "split"))
    assert whole.keys() == split.keys()
    for name in whole:
        assert torch.equal(whole[name], split[name]), name


@needs_gpus(1)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_with_a_falling_loss(tmp_path, precision):
    if precision == "bf16" and torch.cuda.get_device_capability(0)[0] < 8:
        pytest.skip("bfloat16 needs compute capability 8.0; on this GPU cli.py refuses it (tests/test_gpu_defaults.py)")
    config = str(REPO / "configs" / f"{precision}.yaml")
    fit(tmp_path, "whole", "-c", config, "--trainer.devices=1", "--trainer.max_epochs=2")
    (record,) = probe_records(tmp_path / "probe" / "whole", 1)
    assert record["precision"] == {"bf16": "bf16-mixed", "fp16": "16-mixed"}[precision]
    assert record["layer_dtypes"] == [{"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]]
    losses = train_losses(tmp_path, "toy", "whole")
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < 0.5 * losses[0]


@needs_gpus(1)
def test_an_fp16_resume_restores_the_gradient_scaler(tmp_path):
    fp16 = ["-c", str(REPO / "configs" / "fp16.yaml"), "--trainer.devices=1"]
    fit(tmp_path, "run", *fp16, "--trainer.max_epochs=1")
    saved = torch.load(tmp_path / "logs" / "toy" / "run" / "checkpoints" / "last.ckpt", map_location="cpu")
    scaler = saved["MixedPrecision"]
    assert scaler["_growth_tracker"] > 0  # a fresh scaler starts at 0: a restored one is told apart
    fit(tmp_path, "run", *fp16, "--trainer.max_epochs=2")
    (record,) = probe_records(tmp_path / "probe" / "run", 1)
    assert record["scaler_at_start"] == scaler


@needs_gpus(1)
def test_seq2seq_reaches_its_exact_match_on_a_gpu_and_reports_tokens_per_second(tmp_path):
    rate = ["--trainer.callbacks+=tests.helpers.probe.TokenRate", f"--trainer.callbacks.out_dir={tmp_path / 'rate'}"]
    metrics = [
        "--trainer.callbacks+=tests.helpers.probe.MetricProbe",
        f"--trainer.callbacks.out_dir={tmp_path / 'metrics'}",
    ]
    fit(tmp_path, "default", "-c", SEQ2SEQ_YAML, "--trainer.devices=1", *rate, *metrics)
    exact_match = torch.load(tmp_path / "metrics" / "metrics.pt")["val/exact_match"]
    rate = json.loads((tmp_path / "rate" / "tokens.json").read_text())
    print(
        f"seq2seq on {torch.cuda.get_device_name()}: exact match {exact_match:.3f}, "
        f"{rate['tokens'] / rate['seconds']:.0f} tokens/s"
    )
    assert exact_match >= 0.99  # docs/seq2seq.md: on CPU training.StayStopped ends the run after epoch 2 at 0.998
