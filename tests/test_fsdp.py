"""configs/fsdp.yaml: the strategy it builds, Lightning's refusal on CPU, and a sharded checkpoint on 2 GPUs."""

import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch.strategies import FSDPStrategy, Strategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from tests.helpers import DDP_YAML, REPO, run_script
from tests.test_cli import expect_usage_error

FSDP_YAML = REPO / "configs" / "fsdp.yaml"
# Lightning 2.6.6 accepts FSDPStrategy only with accelerator cuda/gpu (accelerator_connector.py), and
# torch 2.13's FSDP, handed device_id=None for a CPU device, stops with "FSDP needs a non-CPU accelerator
# device". So the sharded run needs GPUs.
NEEDS_TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="FSDP is GPU-only with Lightning 2.6.6 and torch 2.13 (Lightning refuses it on CPU, torch's FSDP "
    "needs an accelerator device); this test needs 2 CUDA GPUs",
)


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
    policy = fsdp.kwargs["auto_wrap_policy"]
    assert isinstance(policy, ModuleWrapPolicy) and torch.nn.Linear in policy._module_classes


def test_on_cpu_lightning_refuses_fsdp_with_the_reason(run_cli, capsys):
    err = expect_usage_error(run_cli, capsys, "fit", "-c", DDP_YAML, "-c", str(FSDP_YAML), "--trainer.accelerator=cpu")
    assert "The strategy `fsdp` requires a GPU accelerator, but received `accelerator='cpu'`" in err


def fit_then_reload_a_sharded_checkpoint(workdir: Path, device_args: list[str]) -> None:
    """Train 2 processes, check the sharded checkpoint directory, then validate from it and resume from it."""
    probe = ["--trainer.callbacks+=tests.probe.MetricProbe", f"--trainer.callbacks.out_dir={workdir / 'probe'}"]
    common = ["-c", DDP_YAML, "-c", str(FSDP_YAML), *device_args]
    data = ["--data.init_args.num_train=1024", "--data.init_args.num_val=256"]
    cli = str(REPO / "cli.py")

    fit = run_script([cli, "fit", *common, *data, "--trainer.max_epochs=1"], cwd=workdir)
    assert fit.returncode == 0, fit.stdout + fit.stderr
    checkpoints = workdir / "logs" / "toy" / "default" / "checkpoints"
    last = checkpoints / "last.ckpt"
    assert last.is_dir()
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]

    (best,) = [p for p in checkpoints.iterdir() if p.name.startswith("epoch000-")]
    val_loss = float(re.fullmatch(r"epoch000-val_loss(\d+\.\d{4})\.ckpt", best.name).group(1))
    validate = run_script(
        [cli, "validate", *common, *data, *probe, "--trainer.logger=false", "--ckpt_path", str(best)], cwd=workdir
    )
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert round(torch.load(workdir / "probe" / "metrics.pt")["val/loss"], 4) == val_loss

    resume = run_script([cli, "fit", *common, *data, "--trainer.max_epochs=2", "--ckpt_path", str(last)], cwd=workdir)
    assert resume.returncode == 0, resume.stdout + resume.stderr
    assert "Restored all states from the checkpoint" in resume.stdout + resume.stderr
    resumed = workdir / "logs" / "toy" / "default" / "checkpoints"
    assert any(p.name.startswith("epoch001-") for p in resumed.iterdir())


@pytest.mark.distributed
@NEEDS_TWO_GPUS
def test_two_gpus_save_a_sharded_checkpoint_and_load_it_back(tmp_path):
    fit_then_reload_a_sharded_checkpoint(tmp_path, ["--trainer.accelerator=gpu", "--trainer.devices=2"])
