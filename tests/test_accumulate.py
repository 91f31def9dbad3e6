"""configs/accumulate.yaml, in-process: how often the optimizer steps, and that clipping bounds the gradient it uses."""

import math

import yaml

from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS
from tests.helpers.probe import OptimizerStepProbe

ACCUMULATE_YAML = REPO / "configs" / "accumulate.yaml"


def test_optimizer_steps_once_per_accumulated_group_with_clipped_gradients(run_cli):
    trainer_config = yaml.safe_load(ACCUMULATE_YAML.read_text())["trainer"]
    accumulate, max_norm = trainer_config["accumulate_grad_batches"], trainer_config["gradient_clip_val"]
    batches = 2 * accumulate + accumulate // 2  # two full groups and a shorter last one
    result = run_cli(
        "fit",
        "-c",
        DDP_YAML,
        "-c",
        str(ACCUMULATE_YAML),
        *SINGLE_PROCESS,
        "--trainer.max_epochs=1",
        f"--trainer.limit_train_batches={batches}",
        "--trainer.limit_val_batches=0",
        "--trainer.logger=false",
        "--data.init_args.noise=100",  # targets far off: gradients far above the clipping norm
        "--trainer.callbacks+=tests.helpers.probe.OptimizerStepProbe",
    )
    probe = next(c for c in result.trainer.callbacks if isinstance(c, OptimizerStepProbe))

    # Lightning steps after every `accumulate` batches and on the last batch of the epoch.
    expected = [accumulate] * (batches // accumulate) + [batches % accumulate]
    assert probe.batches_per_step == expected
    assert result.trainer.global_step == len(expected) == math.ceil(batches / accumulate)

    assert len(probe.norms_before_clipping) == len(probe.norms_used) == len(expected)
    assert all(norm > 2 * max_norm for norm in probe.norms_before_clipping), probe.norms_before_clipping
    assert all(norm <= max_norm * (1 + 1e-5) for norm in probe.norms_used), probe.norms_used
