"""Shard directories: scripts/make_shards.py, and the seq2seq DataModule streaming one (equal work per rank,
each validation pair once, an epoch resumed where it stopped, memory of one shard)."""

import json
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from data import Seq2SeqDataModule
from data.seq2seq_batches import EOS
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


def module(folder, world_size: int = 1, rank: int = 0, accumulate: int = 1, **settings) -> Seq2SeqDataModule:
    data = Seq2SeqDataModule(path=str(folder / "shards"), val_fraction=0.05, **{"batch_size": 8, **settings})
    # What the loaders read of a trainer: the epoch is Lightning's, as it passes it to samplers, and the batches
    # of the epoch it counts in its four stages.
    batches = SimpleNamespace(
        **{part: SimpleNamespace(ready=0, started=0, processed=0, completed=0) for part in ("current", "total")}
    )
    progress = SimpleNamespace(
        epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0)),
        epoch_loop=SimpleNamespace(batch_progress=batches),
    )
    data.trainer = SimpleNamespace(
        accelerator=CPUAccelerator(),
        num_devices=1,
        world_size=world_size,
        global_rank=rank,
        accumulate_grad_batches=accumulate,
        fit_loop=progress,
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


@pytest.mark.parametrize(("world_size", "batch_size", "accumulate"), [(1, 8, 1), (2, 8, 1), (3, 7, 2), (4, 16, 1)])
def test_every_rank_gets_the_same_number_of_batches_and_each_pair_is_trained_once(
    shards, world_size, batch_size, accumulate
):
    ranks = [module(shards, world_size, rank, accumulate, batch_size=batch_size) for rank in range(world_size)]
    loaders = [data.train_dataloader() for data in ranks]
    seen = [numbers(loader) for loader in loaders]
    num_train = sum(ranks[0].shards["train"])
    global_batch = world_size * batch_size * accumulate
    tail = (num_train % global_batch) // world_size  # each rank's share of the last, partial step
    expected = num_train // global_batch * accumulate + math.ceil(tail / batch_size)
    assert [len(batches) for batches in seen] == [len(loader) for loader in loaders] == [expected] * world_size
    counts = Counter(i for batches in seen for batch in batches for i in batch)
    assert max(counts.values()) == 1, "a pair was trained twice in one epoch"
    assert set(counts) <= set(range(num_train)) and num_train - len(counts) < world_size, "pairs were left out"


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


def steps(ranks: list[Seq2SeqDataModule]) -> list[set[int]]:
    """The pairs of each optimizer step of an epoch, over every rank and accumulated batch."""
    accumulate = ranks[0].trainer.accumulate_grad_batches
    per_rank = [numbers(data.train_dataloader()) for data in ranks]
    return [
        {i for batches in per_rank for batch in batches[s : s + accumulate] for i in batch}
        for s in range(0, len(per_rank[0]), accumulate)
    ]


@pytest.mark.parametrize(("world_size", "batch_size", "accumulate"), [(2, 12, 1), (2, 6, 2), (4, 6, 1), (1, 24, 1)])
def test_every_step_trains_the_same_pairs_for_any_split_of_the_same_global_batch(
    shards, world_size, batch_size, accumulate
):
    three = steps([module(shards, 3, rank, batch_size=8) for rank in range(3)])
    other = steps([module(shards, world_size, r, accumulate, batch_size=batch_size) for r in range(world_size)])
    full = len(three) - 1  # the last step is the partial one, shared among the ranks there are
    assert len(three[0]) == 24 and other[:full] == three[:full]
    assert len(other) == len(three) and other[full] <= set(range(sum(module(shards).shards["train"])))


@pytest.mark.parametrize(("world_size", "batch_size", "accumulate"), [(2, 12, 1), (2, 6, 2)])
def test_a_job_resumed_on_fewer_processes_trains_the_pairs_the_epoch_had_left_once_each(
    shards, world_size, batch_size, accumulate
):
    """Stopped after 11 steps of 3 processes (batch 8, global batch 24), resumed with the same global batch on
    fewer processes, with a larger batch or with accumulation."""
    before = [module(shards, 3, rank, batch_size=8) for rank in range(3)]
    trained = [numbers(data.train_dataloader())[:11] for data in before]
    state = {"batches_done": 11, "batches_in_epoch": len(trained[0]) + 12, "global_batch": 24, "accumulate": 1}
    after = [module(shards, world_size, rank, accumulate, batch_size=batch_size) for rank in range(world_size)]
    rest = []
    for data in after:
        progress = data.trainer.fit_loop.epoch_loop.batch_progress.current
        progress.ready = progress.started = progress.processed = progress.completed = 11  # as the checkpoint had it
        loader = data.train_dataloader()
        loader.load_state_dict(state)
        rest.append(numbers(loader))
        assert vars(progress) == dict.fromkeys(vars(progress), 11 * accumulate), "Lightning's count did not move"
    whole = [numbers(data.train_dataloader()) for data in after]
    assert [len(batches) for batches in rest] == [len(batches) - 11 * accumulate for batches in whole]
    counts = Counter(i for batches in trained + rest for batch in batches for i in batch)
    num_train = sum(after[0].shards["train"])
    assert max(counts.values()) == 1 and num_train - len(counts) < 24


def test_an_accumulation_cut_short_is_trained_again_and_another_global_batch_is_refused(shards):
    data = module(shards, 2, 0, accumulate=2)
    loader = data.train_dataloader()
    whole = numbers(loader)
    loader.load_state_dict({"batches_done": 5, "batches_in_epoch": len(whole), "global_batch": 32, "accumulate": 2})
    assert numbers(loader) == whole[4:], "the batch accumulated after step 2 never reached the weights"
    assert data.trainer.fit_loop.epoch_loop.batch_progress.total.completed == -1
    with pytest.raises(
        MisconfigurationException,
        match=r"global batch of 48 pairs .* this run's is 32 \(data.batch_size 8 x 2 processes x 2",
    ):
        loader.load_state_dict({"batches_done": 5, "batches_in_epoch": len(whole), "global_batch": 48, "accumulate": 3})
