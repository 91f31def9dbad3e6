"""A model with a head that gets no gradient, in a real 2-process DDP run: a clear stop, or training with the switch."""

import copy
import re
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from models import AuxHeadModel
from tests.helpers import DDP_YAML, REPO, run_job, run_script
from training import UnusedParameterCheck

AUX_HEAD_YAML = str(REPO / "configs" / "aux_head.yaml")
FIND_UNUSED_YAML = str(REPO / "configs" / "find_unused.yaml")
QUICK_RUN = [
    "--trainer.accelerator=cpu",
    "--trainer.max_epochs=1",
    "--data.init_args.num_train=1024",
    "--data.init_args.num_val=256",
]


@pytest.mark.distributed
def test_default_ddp_config_stops_at_the_first_step_and_names_the_parameters(tmp_path):
    result = run_script([str(REPO / "cli.py"), "fit", "-c", DDP_YAML, "-c", AUX_HEAD_YAML, *QUICK_RUN], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output

    named = stopped_with(output)
    assert named == [f"aux_head.{name}" for name, _ in AuxHeadModel().aux_head.named_parameters()]
    # It stopped before DDP's own error at the second step, and before anything was saved.
    assert "Expected to have finished reduction in the prior iteration" not in output
    assert "It looks like your LightningModule has parameters that were not used" not in output
    assert not list(tmp_path.rglob("*.ckpt"))


def stopped_with(output: str) -> list[str]:
    """The parameters named by the one paragraph a run stopped with: no traceback, one paragraph for the job (its
    processes are on one node), which names the config that fixes it."""
    assert "Traceback" not in output, output
    paragraphs = re.findall(
        r"^error: (.*got no gradient in a backward pass of the first training step.*)$", output, re.M
    )
    assert len(paragraphs) == 1, output
    assert "add -c configs/find_unused.yaml" in paragraphs[0]
    assert "--trainer.strategy.init_args.find_unused_parameters=true" in paragraphs[0]
    return re.search(r"first training step[^:]*: (.*?)\. DDP", paragraphs[0]).group(1).split(", ")


@pytest.mark.distributed
def test_find_unused_config_trains_to_the_end(tmp_path):
    configs = ["-c", DDP_YAML, "-c", AUX_HEAD_YAML, "-c", FIND_UNUSED_YAML]
    output, records = run_job(tmp_path, "fit", *configs, *QUICK_RUN)
    assert "`Trainer.fit` stopped: `max_epochs=1` reached." in output

    first, second = (record["params"] for record in records)
    assert any(name.startswith("aux_head.") for name in first)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert (tmp_path / "logs" / "aux_head" / "default" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("aux_weight", [0.0, 0.5])
def test_the_head_gets_gradients_only_with_a_positive_aux_weight(aux_weight):
    model = AuxHeadModel(aux_weight=aux_weight)
    batch = (torch.randn(16, 32), torch.randn(16, 8))
    with pytest.warns(UserWarning, match="self.log"):  # no Trainer here to log to
        model.training_step(batch, 0).backward()
    no_grad = {name for name, p in model.named_parameters() if p.grad is None}
    assert no_grad == ({"aux_head.weight", "aux_head.bias"} if aux_weight == 0 else set())


def first_step(check: UnusedParameterCheck, ddp: DistributedDataParallel, *losses) -> None:
    """The hooks Lightning calls around each backward pass of a first training step (one per loss)."""
    trainer = SimpleNamespace(model=ddp)
    check.on_train_start(trainer, ddp.module)
    for loss in losses:
        value = loss()
        check.on_before_backward(trainer, ddp.module, value)
        value.backward()
        check.on_after_backward(trainer, ddp.module)
    check.on_train_batch_end(trainer, ddp.module, None, None, 0)


@pytest.mark.parametrize(
    ("ddp_options", "stops"),
    [({}, True), ({"find_unused_parameters": True}, False), ({"static_graph": True}, False)],
)
def test_the_check_stops_exactly_the_ddp_runs_that_fail_at_the_next_step(process_group_alone, ddp_options, stops):
    model = AuxHeadModel()
    ddp = DistributedDataParallel(model, **ddp_options)

    def loss() -> torch.Tensor:
        return ddp(torch.randn(16, 32)).square().mean()  # forward() leaves the auxiliary head out

    check = UnusedParameterCheck()
    if stops:
        expected = "got no gradient in a backward pass of the first training step: aux_head.weight, aux_head.bias"
        with pytest.raises(MisconfigurationException, match=expected):
            first_step(check, ddp, loss)
        with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior iteration"):
            loss().backward()
    else:
        first_step(check, ddp, loss)
        loss().backward()


class TwoNetworks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.nn.Linear(4, 8)
        self.discriminator = torch.nn.Linear(8, 1)
        self.automatic_optimization = False

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.discriminator(self.generator(z))


@pytest.mark.parametrize("toggled", [True, False])
def test_under_manual_optimization_every_backward_pass_of_the_first_step_is_checked(process_group_alone, toggled):
    # A GAN's step: the generator's pass, then the discriminator's on a detached fake. With toggle_optimizer the
    # discriminator's parameters require no gradient in the generator's pass; without it, the generator gets none
    # in the discriminator's pass, and nothing is wrong before that second pass.
    model = TwoNetworks()
    ddp = DistributedDataParallel(model)

    def generator_loss() -> torch.Tensor:
        model.discriminator.requires_grad_(not toggled)
        loss = ddp(torch.randn(16, 4)).mean()
        model.discriminator.requires_grad_(True)
        return loss

    def discriminator_loss() -> torch.Tensor:
        return model.discriminator(model.generator(torch.randn(16, 4)).detach()).mean()

    unused = "discriminator.weight, discriminator.bias" if toggled else "generator.weight, generator.bias"
    with pytest.raises(MisconfigurationException, match=rf"manual_backward of a module .*\): {unused}\. DDP"):
        first_step(UnusedParameterCheck(), ddp, generator_loss, discriminator_loss)


class WithAverage(torch.nn.Module):
    """A network and a copy of it that training averages and never trains, as users keep an EMA of their weights:
    torch's AveragedModel (timm's ModelEmaV2 holds a deepcopy the same way) or a deepcopy of their own."""

    def __init__(self, kept_as: str) -> None:
        super().__init__()
        self.automatic_optimization = True
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        averaged = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.999))
        self.ema = averaged if kept_as == "AveragedModel" else copy.deepcopy(self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("kept_as", ["AveragedModel", "deepcopy"])
def test_an_averaged_copy_of_the_model_is_named_as_a_copy_with_requires_grad_off_as_the_fix(
    process_group_alone, kept_as
):
    model = WithAverage(kept_as)

    def loss(ddp: DistributedDataParallel) -> torch.Tensor:
        return ddp(torch.randn(16, 32)).square().mean()

    with pytest.raises(MisconfigurationException) as stopped:
        ddp = DistributedDataParallel(model)
        first_step(UnusedParameterCheck(), ddp, lambda: loss(ddp))
    paragraph = str(stopped.value)
    assert "got no gradient in a backward pass of the first training step: every parameter of ema (a copy of net)" in (
        paragraph
    )
    assert "call self.ema.requires_grad_(False) in the module's __init__" in paragraph
    assert "find_unused.yaml" not in paragraph and "find_unused_parameters=true" not in paragraph
    model = WithAverage(kept_as)
    model.ema.requires_grad_(False)  # the fix it names, in __init__: the copy is no longer DDP's to reduce
    ddp = DistributedDataParallel(model)
    first_step(UnusedParameterCheck(), ddp, lambda: loss(ddp))
    loss(ddp).backward()  # the second step, where DDP would have stopped
    if kept_as == "AveragedModel":
        model.ema.update_parameters(model.net)
        assert int(model.ema.n_averaged) == 1


def test_an_unused_single_layer_is_no_copy_whatever_its_shapes():
    from training.callbacks.unused_parameters import copies_of_others

    model = WithAverage("deepcopy")
    model.head = torch.nn.Linear(16, 8)  # the shapes of net.2, but a head of its own
    assert copies_of_others(model, ["head.weight", "head.bias"]) == {}
    both = [name for name, _ in model.named_parameters() if name.startswith(("ema.", "head."))]
    assert copies_of_others(model, both) == {}  # the head is no copy: the usual advice for all of them
    assert copies_of_others(model, [name for name in both if name.startswith("ema.")]) == {"ema": "net"}
