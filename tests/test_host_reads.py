"""The template adds no host read a GPU would wait for to a training step: beside plain LightningCLI with the same
module, logger, log_every_n_steps and progress-bar refresh, its extra reads come once per logging interval, from the
callbacks that document them."""

from collections import Counter

import torch.distributed as dist
from lightning.pytorch.cli import LightningCLI

from data import RandomDataModule
from models import ToyModel
from tests.helpers import DDP_YAML
from tests.helpers.host_reads import counting

EVERY = 20  # log_every_n_steps, and the progress bar's refresh rate, on both sides
WINDOW = range(EVERY, 3 * EVERY)  # two logging intervals, after the first
RUN = ["--trainer.max_steps=70", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0"]
RUN += ["--trainer.accelerator=cpu", "--trainer.devices=1", f"--trainer.log_every_n_steps={EVERY}"]
PROBE = "--trainer.callbacks+=tests.helpers.host_reads.Probe"
# What the template adds once a logging interval, as its callbacks' docstrings say: StepTime's figures of every
# process, read once (with one all_gather where there are several) and written to the loggers as they are;
# FiniteLoss's notes, one all-reduce read once. On a GPU only the first of them waits for it.
PER_INTERVAL = {"training/step_time/callback.py:gather": 1, "training/callbacks/finite_loss.py:check": 1}
FINITE_LOSS_ALL_REDUCE = 1
# The stop-signal agreement's flags live in host memory: reading them waits for no GPU.
AGREEMENT = "training/checkpoints/preemption.py:on_train_batch_end"


def test_the_template_adds_no_host_read_to_a_step_and_a_few_once_per_logging_interval(run_cli, tmp_path):
    try:
        with counting(WINDOW) as template:
            run_cli("fit", "-c", DDP_YAML, *RUN, PROBE)
    finally:  # the template's DDPStrategy started a process group of one in this process: the tests after it have none
        if dist.is_initialized():
            dist.destroy_process_group()
    plain_args = [*RUN, "--seed_everything=42", "--trainer.logger=TensorBoardLogger"]
    plain_args += [f"--trainer.logger.save_dir={tmp_path / 'plain'}"]
    plain_args += ["--trainer.callbacks+=TQDMProgressBar", f"--trainer.callbacks.refresh_rate={EVERY}", PROBE]
    with counting(WINDOW) as plain:
        LightningCLI(ToyModel, RandomDataModule, args=["fit", *plain_args], save_config_callback=None)
    ours, theirs = Counter(read.step for read in template.reads), Counter(read.step for read in plain.reads)
    agreements = Counter(read.step for read in template.reads if read.site == AGREEMENT)
    for step in WINDOW:
        extra = ours[step] - theirs[step] - agreements[step]
        logging = (step + 1) % EVERY == 0
        allowed = sum(PER_INTERVAL.values()) + FINITE_LOSS_ALL_REDUCE if logging else 0
        assert extra <= allowed, (step, [read for read in template.reads if read.step == step], plain.reads)
    sites = Counter(read.site for read in template.reads if read.site and read.site != AGREEMENT)
    assert sites == {site: count * (len(WINDOW) // EVERY) for site, count in PER_INTERVAL.items()}, sites
