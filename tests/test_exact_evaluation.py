"""`python cli.py test` on 2 processes counts each sample once (training/exact_evaluation.py), as on one process,
against plain LightningCLI on the same module, which counts a repeated sample: 11 numbers, figured through self.log
with sync_dist, torchmetrics and self.all_gather at the epoch's end (tests.zoo.NumberCounter)."""

import json

import pytest

from tests.helpers import DDP_YAML, cli_job, run_script, succeeded

pytestmark = pytest.mark.distributed

MODULE = ["--model=tests.zoo.NumberCounter", "--data=tests.zoo.Numbered", "--trainer.accelerator=cpu"]
PLAIN = "from lightning.pytorch.cli import LightningCLI\n\nLightningCLI()\n"


@pytest.fixture(scope="module")
def tested(tmp_path_factory):
    """The output and figures of the template's test on one process and on 2, and plain LightningCLI's on 2."""
    alone, ours, plain = (tmp_path_factory.mktemp(name) for name in ("alone", "ours", "plain"))
    succeeded(cli_job(alone, "alone", "test", "-c", DDP_YAML, *MODULE, "--trainer.devices=1"))
    output = succeeded(cli_job(ours, "exact", "test", "-c", DDP_YAML, *MODULE, "--trainer.devices=2"))
    (plain / "plain.py").write_text(PLAIN)
    settings = ["--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.logger=false"]
    result = run_script([str(plain / "plain.py"), "test", *MODULE, *settings], cwd=plain)
    assert result.returncode == 0, result.stdout + result.stderr
    return {
        "alone": json.loads((alone / "figures.json").read_text()),
        "ours": (output, json.loads((ours / "figures.json").read_text())),
        "plain": (result.stdout + result.stderr, json.loads((plain / "figures.json").read_text())),
    }


def test_every_figure_counts_each_of_the_11_samples_once_where_plain_lightning_counts_one_twice(tested):
    _, ours = tested["ours"]
    alone = tested["alone"]
    assert (alone["count"], alone["sum"], alone["mean"]) == (11, 55, 5.0)
    assert (ours["count"], ours["sum"], ours["mean"]) == (alone["count"], alone["sum"], alone["mean"])
    assert sorted(alone["gathered"]) == list(range(11))
    _, plain = tested["plain"]
    # DistributedSampler pads rank 1's share of 5 with a repeat of sample 0.
    assert (plain["count"], plain["sum"]) == (12, 55)
    assert plain["mean"] == pytest.approx(55 / 12)


def test_a_gather_of_the_epochs_outputs_works_as_in_plain_lightning_and_says_what_it_repeats(tested):
    output, ours = tested["ours"]
    _, plain = tested["plain"]
    # Rank 0 evaluated 0, 2, ..., 10 and rank 1 1, 3, ..., 9: its 5 rows were padded with a repeat of its last.
    assert ours["gathered"] == [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 9]
    assert plain["gathered"] == [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 0]
    assert output.count("test: self.all_gather got 6 rows from some processes and 5 from others") == 1, output
    assert "During `trainer.test()`, it is recommended to use `Trainer(devices=1" not in output
    assert "During `trainer.test()`, it is recommended to use `Trainer(devices=1" in tested["plain"][0]
