"""Character-level parallel text: your own TSV/JSONL pairs, a shard directory made from them, or a built-in
numbers-to-words corpus.

Everything every rank must agree on is derived without a race: the vocabulary is built at
construction (from the task definition, by reading your file read-only on every rank, or from the shard
directory's index) in sorted order; the built-in corpus is written once per node in ``prepare_data``,
atomically; the validation split comes from a seeded generator in ``setup`` (a shard directory's was made
when it was written).
"""

import os
import uuid
from collections.abc import Sequence
from pathlib import Path

from lightning.pytorch import LightningDataModule
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.plugins.environments import SLURMEnvironment
from torch.utils.data import DataLoader, Dataset, RandomSampler

from data.length_sampler import LengthGroupedBatchSampler
from data.number_corpus import BUILTIN_ALPHABET, builtin_pairs
from data.pairs_file import num_val, read_pairs, read_sources, split_pairs, too_few_sources
from data.seq2seq_batches import BOS, EOS, PAD, SPECIALS, UNK, ItemCollate, Seq2SeqDataset, collate
from data.shards import ShardReader, read_index
from data.streaming import StreamingLoader, StreamingPairs


class Seq2SeqDataModule(LightningDataModule):
    """Pairs of strings for a character-level sequence-to-sequence model.

    With ``path`` unset, ``prepare_data`` writes a built-in corpus (numbers to English words,
    ``"305,017" -> "three hundred five thousand seventeen"``) to ``data_dir``.

    Args:
        path: your parallel data: ``.tsv`` (``source<TAB>target`` per line) or ``.jsonl``
            (``{"source": ..., "target": ...}`` per line), UTF-8, checked in full at start-up and held in memory;
            or a directory that ``scripts/make_shards.py`` made from such a file, streamed a shard at a time.
        data_dir: where the built-in corpus is written.
        num_pairs: size of the built-in corpus.
        max_digits: the built-in corpus has numbers of 1 to ``max_digits`` digits (at most 6).
        val_fraction: share of the distinct sources held out for validation, chosen with ``seed``. Every pair
            of a held-out source leaves training; validation scores each held-out source once. A shard
            directory was split when it was written: this and ``seed`` must be the values it was made with.
        batch_size: pairs per batch **per process**.
        group_by_length: batch training pairs of similar length, so batches carry less padding.
        predict_path: a UTF-8 file with one source per line, for ``predict``.
        num_workers: DataLoader worker processes per training process. Unset, chosen by device: none on CPU,
            where workers would take cores from the training processes; on GPU up to 4, from the cores each
            process has (a SLURM task its own ``--cpus-per-task``, other processes their share of the
            node's), less one for the process itself, so batches are ready while the GPU computes.
        pin_memory: page-locked batches, whose copy to the GPU (Lightning's, ``non_blocking=True``) runs beside
            the GPU's work. On CUDA GPUs only: a CPU run copies nothing (torch would warn).
        persistent_workers: keep the workers from epoch to epoch (and validation) instead of starting them again.
            A shard directory's loader starts them every epoch: that hands them the epoch's order.
        seed: seed of the built-in corpus and of the validation split, independent of ``seed_everything``.

    Attributes linked into the model by cli.py: ``vocab_size``, ``pad_id``, ``bos_id``, ``eos_id``.
    """

    def __init__(
        self,
        path: str | None = None,
        data_dir: str = "cache",
        num_pairs: int = 40000,
        max_digits: int = 6,
        val_fraction: float = 0.05,
        batch_size: int = 64,
        group_by_length: bool = True,
        predict_path: str | None = None,
        num_workers: int | None = None,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name in ("num_pairs", "batch_size"):
            if locals()[name] < 1:
                raise ValueError(f"data.{name} must be a positive integer, got {locals()[name]}")
        if not 1 <= max_digits <= 6:
            raise ValueError(f"data.max_digits must be between 1 and 6, got {max_digits}")
        if path is None and num_pairs > 10**max_digits // 2:
            raise ValueError(
                f"data.num_pairs={num_pairs} is more than half of the {10**max_digits} numbers of up to "
                f"data.max_digits={max_digits} digits; lower it or raise data.max_digits"
            )
        if not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction must be between 0 and 1, got {val_fraction}")
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")
        self.save_hyperparameters()
        # A user file is read here, read-only on every rank, so a bad line stops the run before it starts.
        self.shards = read_index(Path(path)) if path and Path(path).is_dir() else None
        self.pairs = read_pairs(path) if path and self.shards is None else None
        self.predict_sources = read_sources(predict_path) if predict_path else None
        if self.pairs is not None:
            num_val({source for source, _ in self.pairs}, val_fraction)
            alphabet = sorted({c for pair in self.pairs for text in pair for c in text})
        elif self.shards is not None:
            self._check_split(self.shards)
            alphabet = list(self.shards["alphabet"])
        else:
            alphabet = BUILTIN_ALPHABET
        self.vocab = [*SPECIALS, *alphabet]
        self.pad_id, self.bos_id, self.eos_id = PAD, BOS, EOS
        self.splits: dict[str, list[tuple[str, str]]] = {}

    def _check_split(self, index: dict) -> None:
        for name, option in (("val_fraction", "--val-fraction"), ("seed", "--seed")):
            if self.hparams[name] != index[name]:
                raise ValueError(
                    f"data.{name}={self.hparams[name]}, but the shards in {self.hparams.path} were split with "
                    f"{index[name]}; set data.{name}={index[name]}, or convert again with "
                    f"python scripts/make_shards.py {option} {self.hparams[name]} FILE NEW_DIR"
                )

    def processes_problem(self, processes: int) -> str | None:
        """Why this data cannot feed ``processes`` processes, or None: cli.py asks before any process starts."""
        if self.shards is not None:  # split when it was written
            return None
        if self.pairs is None:
            where, more = f"the built-in corpus of data.num_pairs={self.hparams.num_pairs}", "Set data.num_pairs to {}"
            return too_few_sources(self.hparams.num_pairs, where, more, self.hparams.val_fraction, processes)
        sources = len({source for source, _ in self.pairs})
        where, more = f"data.path {self.hparams.path}", "Give at least {} pairs with distinct sources"
        return too_few_sources(sources, where, more, self.hparams.val_fraction, processes)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def corpus_path(self) -> Path:
        hp = self.hparams
        return Path(hp.data_dir) / f"numbers_{hp.max_digits}digits_{hp.num_pairs}pairs_seed{hp.seed}.tsv"

    def prepare_data(self) -> None:
        if self.pairs is not None or self.shards is not None or self.corpus_path.is_file():
            return
        self.corpus_path.parent.mkdir(parents=True, exist_ok=True)
        lines = "".join(
            f"{s}\t{t}\n" for s, t in builtin_pairs(self.hparams.num_pairs, self.hparams.max_digits, self.hparams.seed)
        )
        # Write then rename: a reader never sees half a file, and nodes sharing a filesystem may race harmlessly,
        # each with its own temporary name. A plain open gives the file the umask's permissions, as the run's other
        # files have; a tempfile module file would stay 0600, unreadable to the other users of a shared data_dir.
        partial = self.corpus_path.with_name(f".{self.corpus_path.name}.{uuid.uuid4().hex}.partial")
        with open(partial, "x", encoding="utf-8") as file:
            file.write(lines)
        os.replace(partial, self.corpus_path)

    def setup(self, stage: str) -> None:
        if stage in ("fit", "validate") and not self.splits and self.shards is None:
            pairs = self.pairs if self.pairs is not None else read_pairs(self.corpus_path, "data.data_dir")
            self.splits["train"], self.splits["val"] = split_pairs(pairs, self.hparams.val_fraction, self.hparams.seed)
        if stage == "predict" and self.predict_sources is None:
            raise ValueError("predict needs data.predict_path: a file with one source per line")

    # The vocabulary travels with the checkpoint; on restore it replaces the one built from this run's data.
    def state_dict(self) -> dict[str, list[str]]:
        return {"vocab": self.vocab}

    def load_state_dict(self, state_dict: dict[str, list[str]]) -> None:
        self.vocab = list(state_dict["vocab"])

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Character ids; a character outside the vocabulary becomes ``<unk>``."""
        index = {token: i for i, token in enumerate(self.vocab)}
        return [[index.get(c, UNK) for c in text] for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Text up to the first end token, without padding or start tokens."""
        text = []
        for i in ids:
            if i == EOS:
                break
            if i not in (PAD, BOS):
                text.append(self.vocab[i])
        return "".join(text)

    def _dataset(self, sources: list[str], targets: list[str] | None = None) -> Seq2SeqDataset:
        # Encoded when a loader is built, after a checkpoint's vocabulary has been restored. Sources end
        # with the end token too: attending to it tells the encoder how far each character is from the end.
        encoded_sources = [[*ids, EOS] for ids in self.encode(sources)]
        if targets is None:
            return Seq2SeqDataset(encoded_sources)
        return Seq2SeqDataset(encoded_sources, [[BOS, *ids, EOS] for ids in self.encode(targets)])

    def _loader(self, dataset: Dataset, loader: type[DataLoader] = DataLoader, **kwargs) -> DataLoader:
        on_gpu = self.trainer is not None and isinstance(self.trainer.accelerator, CUDAAccelerator)
        workers = self.hparams.num_workers
        if workers is None:
            workers = max(0, min(4, self._cores_per_process() - 1)) if on_gpu else 0
        # A streaming loader's workers get the epoch and the batches to skip with a new copy of it every epoch.
        persistent = self.hparams.persistent_workers and workers > 0 and not isinstance(dataset, StreamingPairs)
        kwargs.setdefault("collate_fn", collate)
        pin = self.hparams.pin_memory and on_gpu
        return loader(dataset, num_workers=workers, persistent_workers=persistent, pin_memory=pin, **kwargs)

    def _streaming(self, split: str, shuffle: bool) -> StreamingPairs:
        trainer = self.trainer
        return StreamingPairs(
            ShardReader(self.hparams.path, split, self.shards[split]),
            self.hparams.batch_size,
            trainer.world_size if trainer else 1,
            trainer.global_rank if trainer else 0,
            ItemCollate(self.vocab),
            shuffle=shuffle,
            # The run's seed_everything, as Lightning's DistributedSampler has it: another seed, another order.
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
            group_by_length=self.hparams.group_by_length,
            accumulate=trainer.accumulate_grad_batches if trainer else 1,
        )

    def _cores_per_process(self) -> int:
        cores = len(os.sched_getaffinity(0))
        # srun binds each task to its own cores; the processes a launcher starts share the node's.
        if isinstance(getattr(self.trainer.strategy, "cluster_environment", None), SLURMEnvironment):
            return cores
        return cores // self.trainer.num_devices

    def train_dataloader(self) -> DataLoader:
        if self.shards is not None:
            return self._loader(self._streaming("train", True), StreamingLoader, collate_fn=None, trainer=self.trainer)
        sources, targets = zip(*self.splits["train"], strict=True)
        dataset = self._dataset(list(sources), list(targets))
        if not self.hparams.group_by_length:
            return self._loader(dataset, batch_size=self.hparams.batch_size, shuffle=True)
        lengths = [len(s) + len(t) for s, t in zip(dataset.sources, dataset.targets, strict=True)]
        batches = LengthGroupedBatchSampler(RandomSampler(dataset), self.hparams.batch_size, False, lengths)
        return self._loader(dataset, batch_sampler=batches)

    def val_dataloader(self) -> DataLoader:
        if self.shards is not None:
            return self._loader(self._streaming("val", False), batch_size=None, collate_fn=None)
        # Sorted by length so a batch's greedy decoding stops early; the index keeps the pairs' identity.
        pairs = sorted(self.splits["val"], key=lambda pair: (len(pair[1]), len(pair[0])))
        sources, targets = zip(*pairs, strict=True)
        dataset = self._dataset(list(sources), list(targets))
        sampler = None
        if self.trainer is not None and self.trainer.world_size > 1:
            # Lightning's default DistributedSampler repeats samples to even out the ranks, which would
            # count them twice in the metrics; this one gives ranks one sample more or less instead.
            sampler = UnrepeatedDistributedSampler(
                dataset, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
            )
        return self._loader(dataset, batch_size=self.hparams.batch_size, sampler=sampler)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self._dataset(self.predict_sources), batch_size=self.hparams.batch_size)
