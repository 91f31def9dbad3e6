"""Mixed precision: configs/bf16.yaml as a real 2-process gloo run on CPU, and what configs/fp16.yaml does on CPU."""

import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS, run_job

BF16_YAML = str(REPO / "configs" / "bf16.yaml")
FP16_YAML = str(REPO / "configs" / "fp16.yaml")


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("bf16")
    output, records = run_job(
        workdir,
        "fit",
        "-c",
        DDP_YAML,
        "-c",
        BF16_YAML,
        "--trainer.accelerator=cpu",
        "--trainer.max_epochs=2",
        "--trainer.log_every_n_steps=4",
        "--data.init_args.num_train=2048",
    )
    return workdir, output, records


@pytest.mark.distributed
def test_both_ranks_ran_the_forward_pass_in_bfloat16(bf16_run):
    _, output, records = bf16_run
    assert "Using bfloat16 Automatic Mixed Precision (AMP)" in output
    assert [(r["global_rank"], r["world_size"]) for r in records] == [(0, 2), (1, 2)]
    for record in records:
        assert record["precision"] == "bf16-mixed"
        assert record["layer_dtypes"] == ["torch.bfloat16"]


@pytest.mark.distributed
def test_weights_stay_float32_and_identical_on_both_ranks(bf16_run):
    _, _, records = bf16_run
    first, second = (r["params"] for r in records)
    assert first.keys() == second.keys()
    for name in first:
        assert first[name].dtype == torch.float32, name
        assert torch.equal(first[name], second[name]), name


@pytest.mark.distributed
def test_the_loss_is_finite_and_fell(bf16_run):
    workdir, _, _ = bf16_run
    events = EventAccumulator(str(workdir / "logs" / "toy" / "default"))
    events.Reload()
    train = [e.value for e in events.Scalars("train/loss")]
    val = [e.value for e in events.Scalars("val/loss")]
    assert len(train) >= 4 and len(val) == 2
    assert all(math.isfinite(value) for value in train + val)
    assert train[-1] < 0.5 * train[0]
    assert val[-1] < val[0]


def test_fp16_on_cpu_stops_before_training_naming_bf16_mixed(run_cli, capsys):
    # Lightning would train in bfloat16 instead, with a one-line warning among its start-up lines.
    for given, origin in (
        (["-c", FP16_YAML], f"{FP16_YAML} (trainer.precision)"),
        (
            ["--trainer.precision=16-mixed"],
            "--trainer.precision on the command line",
        ),
    ):
        with pytest.raises(SystemExit) as exit_:
            run_cli("fit", "-c", DDP_YAML, *given, *SINGLE_PROCESS, "--trainer.accelerator=cpu")
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"error: {origin} asks for float16 mixed precision, which Lightning runs on CUDA GPUs only" in err
        assert "set trainer.precision=bf16-mixed (configs/bf16.yaml instead of configs/fp16.yaml)" in err
        assert "Traceback" not in err


def test_sync_batchnorm_on_cpu_stops_before_training_with_one_paragraph(run_cli, capsys):
    # Lightning would build the job and every process would stop with "SyncBatchNorm layers only work with GPU
    # modules" at its first batch.
    with pytest.raises(SystemExit) as exit_:
        run_cli("fit", "-c", DDP_YAML, "--trainer.sync_batchnorm=true", *SINGLE_PROCESS, "--trainer.accelerator=cpu")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        "error: --trainer.sync_batchnorm on the command line converts batch norm layers to torch's SyncBatchNorm, which"
        " runs on CUDA GPUs only, and trainer.accelerator=cpu: every process would stop at its first batch." in err
    )
    assert "Traceback" not in err
