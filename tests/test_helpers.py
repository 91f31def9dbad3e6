"""The tests' own helpers where a machine differs from this one: RankProbe (what each rank trained on) on the
seq2seq example's dict batches of different lengths, and charts_path on a machine that has matplotlib but no
network, or neither."""

import importlib.util
from pathlib import Path

import pytest
import torch

import tests.helpers
from data.seq2seq_batches import PAD
from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS, charts_path, probe_args
from tests.test_seq2seq_ddp import SMALL

SEQ2SEQ_YAML = str(REPO / "configs" / "seq2seq.yaml")


def test_the_probe_records_each_source_of_dict_batches_of_different_lengths(run_cli, tmp_path):
    probe = tmp_path / "probe"
    quick = ["--trainer.max_epochs=1", "--trainer.limit_val_batches=0", "--trainer.logger=false"]
    cli = run_cli("fit", "-c", DDP_YAML, "-c", SEQ2SEQ_YAML, *SINGLE_PROCESS, *SMALL, *quick, *probe_args(probe))
    record = torch.load(Path(probe) / "rank0.pt")
    # The default input is a dict batch's first entry, its sources; batches differ in length, so a row each.
    assert isinstance(record["inputs"], list)
    assert len({len(row) for row in record["inputs"]}) > 1, "every batch had the same length"
    unpadded = sorted(tuple(row[row != PAD].tolist()) for row in record["inputs"])
    sources = [row for batch in cli.datamodule.train_dataloader() for row in batch["source"]]
    assert unpadded == sorted(tuple(row[row != PAD].tolist()) for row in sources)


def test_charts_path_takes_the_matplotlib_this_python_imports_and_installs_nothing(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "matplotlib").mkdir(parents=True)
    (site / "matplotlib" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(site)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tests.helpers, "run_script", None)  # pip would be started through it
    assert charts_path() == str(site)
    assert not (tmp_path / "cache").exists()


def test_charts_path_without_matplotlib_or_an_index_fails_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # offline: pip finds no matplotlib anywhere
    with pytest.raises(pytest.fail.Exception) as failed:
        charts_path()
    assert str(failed.value).startswith("this test draws a chart with matplotlib, which ")
    assert "pip could not install requirements-charts.txt (ERROR: No matching distribution found for matplotlib" in (
        str(failed.value)
    )
    assert "offline, from a folder of wheels: pip install --no-index --find-links WHEELS" in str(failed.value)
