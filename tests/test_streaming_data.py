"""Shard directories: scripts/make_shards.py, and the seq2seq DataModule streaming one (equal work per rank,
each validation pair once, an epoch resumed where it stopped, memory of one shard)."""

import json
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator

from data import Seq2SeqDataModule
from data.seq2seq import EOS
from data.shards import ShardReader
from scripts import make_shards
from tests.helpers import write_pairs


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """1,003 pairs in shards of 100: a count no world size or batch size below divides."""
    folder = tmp_path_factory.mktemp("shards")
    pairs = write_pairs(folder / "pairs.tsv", 1003)
    assert make_shards.main([str(pairs), str(folder / "shards"), "--shard-size=100", "--val-fraction=0.05"]) == 0
    return folder


def module(folder, world_size: int = 1, rank: int = 0, **settings) -> Seq2SeqDataModule:
    data = Seq2SeqDataModule(path=str(folder / "shards"), val_fraction=0.05, **{"batch_size": 8, **settings})
    # What the loaders read of a trainer: the epoch is Lightning's, as it passes it to samplers.
    progress = SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0)))
    data.trainer = SimpleNamespace(
        accelerator=CPUAccelerator(), num_devices=1, world_size=world_size, global_rank=rank, fit_loop=progress
    )
    data.setup("fit")
    return data


def numbers(loader) -> list[list[int]]:
    return [batch["index"].tolist() for batch in loader]


def test_shards_hold_the_split_the_file_gets_in_memory(shards):
    in_memory = Seq2SeqDataModule(path=str(shards / "pairs.tsv"), val_fraction=0.05)
    in_memory.setup("fit")
    streamed = module(shards)
    index = json.loads((shards / "shards" / "index.json").read_text())
    train = ShardReader(shards / "shards", "train", index["train"])
    val = ShardReader(shards / "shards", "val", index["val"])
    assert sorted(p for k in range(len(index["train"])) for p in train.shard(k)) == sorted(in_memory.splits["train"])
    assert sorted(val.shard(0)) == sorted(in_memory.splits["val"])
    assert streamed.vocab == in_memory.vocab
    assert index["train"] == [100] * 9 + [len(in_memory.splits["train"]) - 900]


def test_bad_input_gets_the_message_data_path_gets_and_leaves_no_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.jsonl").write_text('{"source": "1", "target": "one"}\n{"source": "2", "text": "two"}\n')
    assert make_shards.main(["pairs.jsonl", "out"]) == 2
    expected = (
        'error: INPUT: pairs.jsonl:2: unknown field \'text\'; each line must be {"source": "...", "target": "..."}'
    )
    assert capsys.readouterr().err.splitlines()[-1] == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl"]


def test_an_existing_output_directory_is_never_written_into(shards, capsys):
    before = sorted(p.name for p in (shards / "shards").iterdir())
    with pytest.raises(SystemExit) as exit_info:
        make_shards.main([str(shards / "pairs.tsv"), str(shards / "shards")])
    assert exit_info.value.code == 2
    assert "already exists; give a new directory" in capsys.readouterr().err
    assert sorted(p.name for p in (shards / "shards").iterdir()) == before


def test_a_directory_that_is_not_a_shard_directory_or_was_split_otherwise_is_refused(shards, tmp_path):
    with pytest.raises(ValueError, match=r"data.path: .* is a directory without index.json; convert your file with"):
        Seq2SeqDataModule(path=str(tmp_path))
    with pytest.raises(ValueError, match=r"data.val_fraction=0.025, but the shards in .* were split with 0.05"):
        Seq2SeqDataModule(path=str(shards / "shards"), val_fraction=0.025)


@pytest.mark.parametrize(("world_size", "batch_size"), [(1, 8), (2, 8), (3, 7), (4, 16)])
def test_every_rank_gets_the_same_number_of_batches_and_every_pair_is_trained(shards, world_size, batch_size):
    ranks = [module(shards, world_size, rank, batch_size=batch_size) for rank in range(world_size)]
    loaders = [data.train_dataloader() for data in ranks]
    seen = [numbers(loader) for loader in loaders]
    num_train = sum(ranks[0].shards["train"])
    expected = math.ceil(math.ceil(num_train / world_size) / batch_size)
    assert [len(batches) for batches in seen] == [len(loader) for loader in loaders] == [expected] * world_size
    counts = Counter(i for batches in seen for batch in batches for i in batch)
    assert sorted(counts) == list(range(num_train)), "a pair was left out"
    assert sum(counts.values()) - num_train < world_size, "more pairs repeated than it takes to even out the ranks"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_validation_scores_each_pair_once_across_ranks(shards, world_size):
    seen = [numbers(module(shards, world_size, rank).val_dataloader()) for rank in range(world_size)]
    flat = [i for batches in seen for batch in batches for i in batch]
    assert sorted(flat) == list(range(sum(module(shards).shards["val"])))


def test_a_resumed_epoch_gives_exactly_the_batches_the_whole_epoch_had_left(shards):
    data = module(shards, world_size=2, rank=1)
    data.trainer.fit_loop.epoch_progress.current.processed = 1
    loader = data.train_dataloader()
    whole = numbers(loader)
    loader.load_state_dict({"batches_done": 23, "batches_in_epoch": len(whole)})
    assert numbers(loader) == whole[23:]
    assert numbers(loader) == whole, "the epoch after it started part-way too"
    loader.load_state_dict({"batches_done": len(whole), "batches_in_epoch": len(whole)})  # the epoch had ended
    assert numbers(loader) == whole
    data.trainer.fit_loop.epoch_progress.current.processed = 2
    assert numbers(loader) != whole, "every epoch has the same order"


def test_batches_are_grouped_by_length_and_encoded_like_the_in_memory_ones(shards):
    loader = module(shards).train_dataloader()
    batches = list(loader)
    padding = sum(int(b["target_padding_mask"].sum()) for b in batches) / sum(b["target"].numel() for b in batches)
    assert padding < 0.1
    batch = batches[0]
    assert int(batch["source"][0, (~batch["source_padding_mask"][0]).sum() - 1]) == EOS


def test_worker_processes_give_the_batches_of_the_main_process(shards):
    in_main = module(shards).train_dataloader()
    in_workers = module(shards, num_workers=2).train_dataloader()
    assert not in_workers.persistent_workers, "workers would keep the epoch of their first copy"
    in_workers.load_state_dict({"batches_done": 3, "batches_in_epoch": len(in_workers)})
    assert numbers(in_workers) == numbers(in_main)[3:]


def test_memory_holds_one_shard(shards):
    loader = module(shards).train_dataloader()
    held = []
    for _ in loader:
        held.append(len(loader.dataset.reader.loaded[1]))
    assert max(held) == 100
    assert torch.tensor(held).numel() == len(loader)
