"""Token ids of parallel text and their batches: the dataset of encoded pairs, padding with its mask, and the
collate functions of the in-memory and the streaming path, which give the model the same batch for the same pairs."""

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from data.streaming import Item

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
PAD, BOS, EOS, UNK = range(len(SPECIALS))


class Seq2SeqDataset(Dataset):
    """Token-id sequences, ``targets`` None for prediction; items carry their index to put outputs back in order."""

    def __init__(self, sources: list[list[int]], targets: list[list[int]] | None = None) -> None:
        self.sources = sources
        self.targets = targets

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, index: int) -> tuple[int, list[int], list[int] | None]:
        return index, self.sources[index], self.targets[index] if self.targets is not None else None


def pad(sequences: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence of this batch; the mask is True on padding (PyTorch's key_padding_mask)."""
    ids = pad_sequence([torch.tensor(s) for s in sequences], batch_first=True, padding_value=PAD)
    lengths = torch.tensor([len(s) for s in sequences])
    return ids, torch.arange(ids.size(1)) >= lengths[:, None]


def collate(items: list[tuple[int, list[int], list[int] | None]]) -> dict[str, torch.Tensor]:
    """``index``, ``source``, ``source_padding_mask`` and, with targets, ``target``, ``target_padding_mask``."""
    indices, sources, targets = zip(*items, strict=True)
    batch = dict(zip(("source", "source_padding_mask"), pad(sources), strict=True))
    batch["index"] = torch.tensor(indices)
    if targets[0] is not None:
        batch.update(zip(("target", "target_padding_mask"), pad(targets), strict=True))
    return batch


class ItemCollate:
    """Batches of a shard directory's ``(number, source, target)`` items, encoded with ``vocab``."""

    def __init__(self, vocab: Sequence[str]) -> None:
        self.index = {token: i for i, token in enumerate(vocab)}

    def __call__(self, items: list[Item]) -> dict[str, torch.Tensor]:
        return collate([(n, [*self.encode(s), EOS], [BOS, *self.encode(t), EOS]) for n, s, t in items])

    def encode(self, text: str) -> list[int]:
        return [self.index.get(c, UNK) for c in text]
