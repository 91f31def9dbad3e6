"""A model with a head that gets no gradient, in a real 2-process DDP run: a clear stop, or training with the switch."""

import re
from types import SimpleNamespace

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

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
    assert result.returncode != 0, output

    messages = re.findall(r"RuntimeError: (.*got no gradient in the first training step.*)", output)
    assert len(messages) == 2, output  # one per rank
    named = re.search(r"first training step: (.*?)\. DDP", messages[0]).group(1).split(", ")
    assert named == [f"aux_head.{name}" for name, _ in AuxHeadModel().aux_head.named_parameters()]
    assert "-c configs/find_unused.yaml" in messages[0]
    assert "--trainer.strategy.init_args.find_unused_parameters=true" in messages[0]
    # It stopped before DDP's own error at the second step, and before anything was saved.
    assert "Expected to have finished reduction in the prior iteration" not in output
    assert "It looks like your LightningModule has parameters that were not used" not in output
    assert not list(tmp_path.rglob("*.ckpt"))


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


@pytest.fixture
def one_process_group():
    """A gloo process group of this process alone, enough to build a DistributedDataParallel in-process."""
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    ("ddp_options", "stops"),
    [({}, True), ({"find_unused_parameters": True}, False), ({"static_graph": True}, False)],
)
def test_the_check_stops_exactly_the_ddp_runs_that_fail_at_the_next_step(one_process_group, ddp_options, stops):
    model = AuxHeadModel()
    ddp = DistributedDataParallel(model, **ddp_options)

    def step() -> None:
        ddp(torch.randn(16, 32)).square().mean().backward()  # forward() leaves the auxiliary head out

    step()
    check = UnusedParameterCheck()
    if stops:
        expected = "got no gradient in the first training step: aux_head.weight, aux_head.bias"
        with pytest.raises(RuntimeError, match=expected):
            check.on_after_backward(SimpleNamespace(model=ddp), model)
        with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior iteration"):
            step()
    else:
        check.on_after_backward(SimpleNamespace(model=ddp), model)
        step()
