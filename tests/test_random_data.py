"""The random regression DataModule: determinism and the whole-batch data path."""

from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader, TensorDataset

from data import RandomDataModule
from data.random_data import TensorBatchDataset, batch_loader
from data.resumable import ResumableDataLoader


def make(**kwargs) -> RandomDataModule:
    data = RandomDataModule(num_train=256, num_val=64, num_test=32, **kwargs)
    data.setup("fit")
    return data


def test_same_seed_gives_the_same_data_and_another_seed_does_not():
    first, again, other = make(seed=3), make(seed=3), make(seed=4)
    for split in ("train", "val", "test"):
        for a, b in zip(first.splits[split].tensors, again.splits[split].tensors, strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(first.splits["train"].tensors[0], other.splits["train"].tensors[0])


def test_splits_have_the_requested_sizes_and_do_not_overlap():
    data = make()
    sizes = {name: len(split) for name, split in data.splits.items()}
    assert sizes == {"train": 256, "val": 64, "test": 32}
    rows = {row.numpy().tobytes() for split in data.splits.values() for row in split.tensors[0]}
    assert len(rows) == 256 + 64 + 32


def test_whole_batch_loader_yields_what_a_per_sample_collate_yields():
    x, y = torch.randn(100, 4), torch.randn(100, 2)
    batched = batch_loader(TensorBatchDataset(x, y), batch_size=16, shuffle=True, pin_memory=False)
    per_sample = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    torch.manual_seed(0)
    got = list(batched)
    torch.manual_seed(0)
    expected = list(per_sample)
    assert len(got) == len(expected) == 7
    for (gx, gy), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(gx, ex) and torch.equal(gy, ey)


def test_whole_batch_dataset_is_indexed_once_per_batch():
    calls = []

    class Counting(TensorBatchDataset):
        def __getitem__(self, index):
            calls.append(index)
            return super().__getitem__(index)

    loader = batch_loader(Counting(torch.arange(64.0)), batch_size=32, shuffle=False, pin_memory=False)
    batches = [batch for (batch,) in loader]
    assert calls == []
    assert [b.shape for b in batches] == [torch.Size([32]), torch.Size([32])]


def test_an_epoch_resumed_on_another_number_of_processes_trains_the_samples_it_had_left():
    numbers = list(range(23))
    before = [ResumableDataLoader(numbers, 2, SimpleNamespace(world_size=3, global_rank=r)) for r in range(3)]
    trained = [i for loader in before for batch in list(loader)[:2] for i in batch.tolist()]  # 2 steps of 3 x 2
    state = {"batches_done": 2, "batches_in_epoch": len(before[0]), "batch_size": 2, "world_size": 3}
    after = [ResumableDataLoader(numbers, 3, SimpleNamespace(world_size=2, global_rank=r)) for r in range(2)]
    for loader in after:
        loader.load_state_dict(state)
    rest = [[i for batch in loader for i in batch.tolist()] for loader in after]
    assert len(rest[0]) == len(rest[1]) == 6, "the 11 samples left, evened out over 2 processes"
    assert sorted(trained + rest[0] + rest[1]) == sorted([*numbers, rest[0][0]]), "one sample repeated, none lost"
    assert [i for batch in after[0] for i in batch.tolist()] != rest[0], "only the resumed epoch skips"
