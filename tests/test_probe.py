"""tests.helpers.probe.RankProbe, the tests' record of what each rank trained on, on the seq2seq example's batches:
dicts of tensors padded to each batch's longest sequence."""

from pathlib import Path

import torch

from data.seq2seq_batches import PAD
from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS, probe_args
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
