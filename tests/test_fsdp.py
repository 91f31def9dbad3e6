"""configs/fsdp.yaml: the strategy and shard units it builds, what it cannot combine with, Lightning's refusal on CPU,
and sharded checkpoints on GPUs."""

import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import FSDPStrategy, Strategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from data.seq2seq_batches import BOS, EOS, collate
from models import Seq2SeqTransformer
from models.seq2seq import DecoderLayer
from tests.helpers import DDP_YAML, REPO, needs_gpus, run_script
from tests.test_cli import expect_usage_error
from training.config.loader import file_name

FSDP_YAML = REPO / "configs" / "fsdp.yaml"
ACCUMULATE_YAML = str(REPO / "configs" / "accumulate.yaml")
SEQ2SEQ_YAML = str(REPO / "configs" / "seq2seq.yaml")


def config_strategy(path: Path) -> Strategy:
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Strategy)
    config = parser.parse_object({"strategy": yaml.safe_load(path.read_text())["trainer"]["strategy"]})
    return parser.instantiate(config).strategy


def test_the_config_builds_a_sharded_fsdp_strategy_with_a_longer_timeout():
    fsdp, ddp = config_strategy(FSDP_YAML), config_strategy(Path(DDP_YAML))
    assert type(fsdp) is FSDPStrategy
    assert fsdp._state_dict_type == "sharded"
    assert fsdp._timeout > ddp._timeout >= timedelta(minutes=30)
    assert isinstance(fsdp.kwargs["auto_wrap_policy"], ModuleWrapPolicy)


def misused_units(model: torch.nn.Module, units: tuple[type, ...], run: Callable[[], object]) -> list[str]:
    """The shard units of ``model`` used other than through their own forward while ``run`` runs.

    FSDP gathers a unit's parameters only around the unit's forward: a unit whose forward never runs (its
    parent reads its weights directly) or whose parts run outside it would compute with a shard on GPUs.
    """
    named = {name: module for name, module in model.named_modules() if isinstance(module, units)}
    active, ran, misuse = set(), set(), []

    def hooks(name: str) -> tuple[Callable, Callable, Callable]:  # a hook that returns a value replaces the output
        def enter(*_) -> None:
            active.add(name)

        def leave(*_) -> None:
            active.discard(name)
            ran.add(name)

        def part_runs(module, _) -> None:
            if name not in active:
                misuse.append(f"{name}.{parts[module]} ran outside {name}'s forward")

        return enter, leave, part_runs

    parts = {}
    for name, unit in named.items():
        enter, leave, part_runs = hooks(name)
        unit.register_forward_pre_hook(enter)
        unit.register_forward_hook(leave)
        for part, module in unit.named_modules():
            if module is not unit:
                parts[module] = part
                module.register_forward_pre_hook(part_runs)
    run()
    return misuse + [f"{name}'s forward never ran" for name in named if name not in ran]


@pytest.mark.parametrize("classes", [None, [torch.nn.Linear], [DecoderLayer]])
def test_the_policy_shards_seq2seq_in_units_that_run_through_their_own_forward(classes):
    units = tuple(classes or config_strategy(FSDP_YAML).kwargs["auto_wrap_policy"]._module_classes)
    torch.manual_seed(0)
    model = Seq2SeqTransformer(vocab_size=12, d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2)
    batch = collate([(i, [4 + i % 6] * (1 + i % 4), [BOS, 5 + i % 5, EOS]) for i in range(4)])

    def step() -> None:  # what a training and a validation step run: teacher forcing, then greedy decoding
        model(batch["source"], batch["source_padding_mask"], batch["target"], batch["target_padding_mask"])
        model.generate(batch["source"], batch["source_padding_mask"], max_length=4)

    misuse = misused_units(model, units, step)
    if classes is None:  # the config's policy
        assert misuse == []
        assert any(isinstance(module, units) for module in model.modules()), "the seq2seq model is not sharded"
    else:  # the policies it replaces: a unit read from outside
        assert misuse and all("encoder" in m or "decoder" in m for m in misuse), misuse


def test_fsdp_with_clipping_by_norm_stops_before_training_naming_both_files(run_cli, capsys, monkeypatch):
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))  # FSDP's own check passes
    err = expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "-c", str(FSDP_YAML), "-c", ACCUMULATE_YAML)
    assert f"{FSDP_YAML} (trainer.strategy) shards the model with FSDP" in err
    assert f"{ACCUMULATE_YAML} (trainer.gradient_clip_val) clips gradients by their norm" in err
    assert "--trainer.gradient_clip_algorithm=value" in err
    assert "Traceback" not in err


def test_fsdp_on_cpu_stops_before_training_saying_it_needs_gpus_and_what_runs_on_cpu(run_cli, capsys, monkeypatch):
    err = expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "-c", str(FSDP_YAML), "--trainer.accelerator=cpu")
    assert (
        f"error: {FSDP_YAML} (trainer.strategy) shards the model with FSDP, which runs on CUDA GPUs only, and " in err
    )
    assert "and trainer.accelerator=cpu. On CPU, train with DDP, the strategy of configs/ddp.yaml" in err

    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: False))
    err = expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "--trainer.strategy=fsdp")
    assert "error: --trainer.strategy on the command line shards the model with FSDP, which runs on CUDA GPUs" in err
    assert "and this machine has no CUDA GPU. On CPU, train with DDP" in err
    assert "accelerator='cuda'" not in err and "Traceback" not in err


def fit_then_reload_a_sharded_checkpoint(workdir: Path, processes: int, *args: str, name: str = "toy") -> None:
    """Train, check the sharded checkpoint directory, then validate from it and resume from it."""
    probe = ["--trainer.callbacks+=tests.helpers.probe.MetricProbe", f"--trainer.callbacks.out_dir={workdir / 'probe'}"]
    common = ["-c", DDP_YAML, "-c", str(FSDP_YAML), "--trainer.accelerator=gpu", f"--trainer.devices={processes}"]
    common += args
    cli = str(REPO / "cli.py")

    fit = run_script([cli, "fit", *common, "--trainer.max_epochs=1"], cwd=workdir)
    assert fit.returncode == 0, fit.stdout + fit.stderr
    checkpoints = workdir / "logs" / name / "default" / "checkpoints"
    last = checkpoints / "last.ckpt"
    assert last.is_dir()
    shards = [f"__{rank}_0.distcp" for rank in range(processes)]
    assert sorted(p.name for p in last.iterdir()) == sorted([".metadata", *shards, "meta.pt"])

    # The best file is named by the metric the run monitored (seq2seq's is val/exact_match), as its config.yaml says.
    monitor = yaml.safe_load((checkpoints.parent / "config.yaml").read_text())["monitor"]
    (best,) = [p for p in checkpoints.iterdir() if p.name.startswith("epoch000-")]
    named = re.fullmatch(rf"epoch000-{re.escape(file_name(monitor))}(\d+\.\d{{4}})\.ckpt", best.name)
    assert named, f"{best.name} is not named by {monitor}"
    validate = run_script(
        [cli, "validate", *common, *probe, "--trainer.logger=false", "--ckpt_path", str(best)], cwd=workdir
    )
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert round(torch.load(workdir / "probe" / "metrics.pt")[monitor], 4) == float(named.group(1))

    resume = run_script([cli, "fit", *common, "--trainer.max_epochs=2", "--ckpt_path", str(last)], cwd=workdir)
    assert resume.returncode == 0, resume.stdout + resume.stderr
    assert "Restored all states from the checkpoint" in resume.stdout + resume.stderr
    assert any(p.name.startswith("epoch001-") for p in checkpoints.iterdir())


TOY_DATA = ["--data.init_args.num_train=1024", "--data.init_args.num_val=256"]


@pytest.mark.distributed
@needs_gpus(2)
def test_two_gpus_save_a_sharded_checkpoint_and_load_it_back(tmp_path):
    fit_then_reload_a_sharded_checkpoint(tmp_path, 2, *TOY_DATA)


@needs_gpus(1)
def test_one_gpu_saves_a_sharded_checkpoint_and_loads_it_back_with_clipping_by_value(tmp_path):
    clip = ["-c", ACCUMULATE_YAML, "--trainer.gradient_clip_algorithm=value"]  # what the combination error offers
    fit_then_reload_a_sharded_checkpoint(tmp_path, 1, *TOY_DATA, *clip)


@needs_gpus(1)
def test_seq2seq_on_one_gpu_saves_a_sharded_checkpoint_and_loads_it_back(tmp_path):
    fit_then_reload_a_sharded_checkpoint(
        tmp_path, 1, "-c", SEQ2SEQ_YAML, "--data.init_args.num_pairs=4000", name="seq2seq"
    )
