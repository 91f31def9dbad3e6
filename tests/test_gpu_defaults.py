"""configs/seq2seq_gpu.yaml: the settings it gives, a CPU run with them, bfloat16 refused on a GPU without it, and
``python -m benchmarks.gpu_defaults --quick``, which measures each setting alone."""

import json
import subprocess
import sys
import warnings

import pytest
import torch
import yaml
from lightning.pytorch.accelerators import CUDAAccelerator

from benchmarks.gpu_defaults import describe
from benchmarks.workloads import WORKLOADS
from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS, needs_gpus
from training.config.gpu_support import bf16_problem

SEQ2SEQ_YAML = str(REPO / "configs" / "seq2seq.yaml")
GPU_YAML = str(REPO / "configs" / "seq2seq_gpu.yaml")
CONFIGS = ("-c", DDP_YAML, "-c", SEQ2SEQ_YAML, "-c", GPU_YAML)


def test_the_gpu_config_asks_for_bf16_fused_adamw_kept_workers_and_pinned_memory(run_cli, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", *CONFIGS, "--print_config")
    assert exit_info.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["precision"] == "bf16-mixed"
    assert config["matmul_precision"] == "high"  # configs/ddp.yaml's, which the GPU config counts on
    optimizer = config["model"]["init_args"]["optimizer"]
    assert optimizer["class_path"] == "torch.optim.AdamW"
    assert optimizer["init_args"]["fused"] is True
    assert optimizer["init_args"]["lr"] == 0.002  # configs/seq2seq.yaml's, kept under the added setting
    data = config["data"]["init_args"]
    assert (data["num_workers"], data["persistent_workers"], data["pin_memory"]) == (None, True, True)


def test_a_cpu_run_with_the_gpu_settings_trains_with_fused_adamw_and_kept_workers(run_cli, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_cli(
            "fit",
            *CONFIGS,
            *SINGLE_PROCESS,
            *(o for o in WORKLOADS["seq2seq"].quick_overrides if "data_dir" not in o),  # bench.py --quick's sizes
            f"--data.init_args.data_dir={tmp_path / 'cache'}",
            "--data.init_args.num_workers=1",  # by device, a CPU run has none: one, to see them kept
            "--trainer.accelerator=cpu",
            "--trainer.max_steps=3",
            "--trainer.val_check_interval=3",
            "--trainer.limit_val_batches=1",
            "--trainer.logger=false",
        )
    trainer = result.trainer
    assert trainer.global_step == 3
    assert trainer.precision == "bf16-mixed"  # on CPU too: autocast to bfloat16
    assert trainer.optimizers[0].defaults["fused"] is True
    loader = trainer.train_dataloader
    assert (loader.num_workers, loader.persistent_workers) == (1, True)
    # Nothing to pin on CPU: the loader leaves it, rather than torch warning about it every epoch.
    assert loader.pin_memory is False
    assert not [w for w in caught if "pin_memory" in str(w.message)]
    assert 0 <= float(trainer.callback_metrics["val/exact_match"]) <= 1


@pytest.fixture
def one_old_gpu(monkeypatch):
    """A node with one GPU of compute capability 7.0 (a V100): no bfloat16 units."""
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")


def test_bf16_on_a_gpu_without_bfloat16_units_is_refused_naming_the_setting(run_cli, capsys, one_old_gpu, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", *CONFIGS, "--trainer.devices=1")
    assert exit_info.value.code != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err
    assert (
        f"error: {GPU_YAML} (trainer.precision) asks for bfloat16, and GPU 0 of this node (Tesla V100-SXM2-16GB, "
        "compute capability 7.0) has no bfloat16 units"
    ) in err
    assert "set trainer.precision=16-mixed" in err and "configs/fp16.yaml" in err
    assert not (tmp_path / "logs").exists()  # refused before anything was built


@pytest.mark.parametrize(
    ("trainer", "refused"),
    [
        ({"precision": "bf16-mixed"}, True),
        ({"precision": "bf16-true", "devices": [0]}, True),
        ({"precision": "16-mixed"}, False),  # the fix the paragraph gives
        ({"precision": "32-true"}, False),
        ({"precision": "bf16-mixed", "accelerator": "cpu"}, False),  # CPUs run bfloat16
    ],
)
def test_only_bfloat16_on_the_gpu_is_refused(one_old_gpu, trainer, refused):
    assert (bf16_problem({"trainer": trainer}) is not None) == refused


def test_the_gpus_a_run_takes_are_the_ones_checked(monkeypatch, one_old_gpu):
    # GPU 0 a V100, GPU 1 an A100: a run on GPU 1 alone has bfloat16 units.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0) if device == 0 else (8, 0))
    assert bf16_problem({"trainer": {"precision": "bf16-mixed", "devices": [1]}}) is None
    assert bf16_problem({"trainer": {"precision": "bf16-mixed", "devices": "1,"}}) is None
    assert "GPU 0 of this node" in bf16_problem({"trainer": {"precision": "bf16-mixed", "devices": "auto"}})
    assert bf16_problem({"trainer": {"precision": "bf16-mixed", "devices": [5]}}) is None  # Lightning names it


def test_each_side_of_the_benchmark_differs_from_plain_in_one_choice_alone():
    from benchmarks.gpu_defaults import CHOICES, side_flags

    sides = side_flags("gpu")
    plain = set(sides["plain"])
    assert sides["gpu defaults"] == ()
    assert set(sides) == {"plain", "gpu defaults", *(f"+{name}" for name in CHOICES)}
    for name, (_, flags) in CHOICES.items():
        assert plain - set(sides[f"+{name}"]) == set(flags), name
    # On CPU the loader choices change nothing: their sides would be plain again.
    assert side_flags("cpu") == {side: flags for side, flags in sides.items() if side not in ("+workers", "+pinned")}


def test_a_side_times_the_span_of_its_steps_after_warm_up():
    from types import SimpleNamespace

    from benchmarks.gpu_defaults_side import SpanTimer

    timer, module = SpanTimer(warmup=2), SimpleNamespace(device=torch.device("cpu"))
    starts = []
    for batch_idx in range(5):
        timer.on_train_batch_start(None, module, None, batch_idx)
        starts.append(timer.start)
    timer.on_train_end(None, module)
    assert starts[1] == 0.0 < starts[2] == starts[4]  # the clock read at the third step, the first after warm-up
    assert timer.batches - timer.warmup == 3 and timer.end > timer.start


def test_the_benchmark_on_gpus_stops_without_one_naming_the_flag(monkeypatch, capsys):
    from benchmarks import gpu_defaults

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["gpu_defaults", "--quick", "--accelerator", "gpu"])
    with pytest.raises(SystemExit) as exit_info:
        gpu_defaults.main()
    assert exit_info.value.code == 2
    assert "--accelerator gpu needs a CUDA GPU" in capsys.readouterr().err


def quick_benchmark(out, accelerator: str) -> tuple[dict[str, str], dict[str, dict]]:
    """``python -m benchmarks.gpu_defaults --quick`` on ``accelerator``: its table's rows by side, and each side's
    settings in effect from its JSON, after checking every side has a step time and an exact match."""
    command = [sys.executable, "-m", "benchmarks.gpu_defaults", "--quick", "--accelerator", accelerator, "--out", out]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-2].startswith("gpu defaults against Lightning's defaults: ")
    sides = json.loads((out / "gpu_defaults.json").read_text())["sides"]
    loader_sides = {"+workers", "+pinned"} if accelerator == "gpu" else set()
    assert set(sides) == {"plain", "gpu defaults", "+bf16", "+tf32", "+fused", *loader_sides}
    for row in sides.values():
        assert row["step_ms"] > 0 and 0 <= row["exact_match"] <= 1
    # The rows: each side's name right-aligned in the first 14 characters.
    rows = {line[:14].strip(): line for line in result.stdout.splitlines()}
    return rows, {side: row["settings"] for side, row in sides.items()}


def expected_settings(side: str, on_gpu: bool) -> dict:
    """What a side runs with: Lightning's defaults but for its one choice; the GPU defaults every choice. On CPU
    the loader choices change nothing: no workers by device, nothing to pin."""
    has = {name: side in ("gpu defaults", f"+{name}") for name in ("bf16", "tf32", "fused", "workers", "pinned")}
    return {
        "precision": "bf16-mixed" if has["bf16"] else "32-true",
        "matmul_precision": "high" if has["tf32"] else "highest",
        "fused": has["fused"],
        "persistent_workers": has["workers"] and on_gpu,
        "pin_memory": has["pinned"] and on_gpu,
    }


@pytest.mark.distributed
def test_the_quick_benchmark_prints_every_side_with_the_settings_it_had_and_the_headline(tmp_path):
    rows, settings = quick_benchmark(tmp_path, "cpu")
    for side, had in settings.items():
        assert {key: had[key] for key in expected_settings(side, False)} == expected_settings(side, False), side
        assert had["num_workers"] == 0, side
        assert describe(had) in rows[side], rows.get(side)
    assert "plain" in rows["plain"] and "32-true, matmul highest, unfused AdamW, 0 workers, pageable" in rows["plain"]
    assert any("not run on cpu: +workers and +pinned, the same as plain there" in line for line in rows.values())


@needs_gpus(1)
def test_on_a_gpu_each_side_has_its_one_setting_in_effect(tmp_path):
    if torch.cuda.get_device_capability(0)[0] < 8:
        pytest.skip("bfloat16 needs compute capability 8.0; this GPU's refusal is tested on CPU")
    _, settings = quick_benchmark(tmp_path, "gpu")
    for side, had in settings.items():
        assert {key: had[key] for key in expected_settings(side, True)} == expected_settings(side, True), side
        assert (had["num_workers"] > 0) == (side in ("gpu defaults", "+workers")), side
