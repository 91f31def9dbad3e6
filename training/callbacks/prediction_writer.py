"""What ``cli.py predict`` writes: one file in the run's directory, in input order, once, however many processes."""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter

from training.run.record import run_directory
from training.run.storage import is_remote


def unbatch(batch: Any) -> list[Any]:
    """A batch of predictions (a tensor, or a dict, list or tuple of them) as one prediction per input."""
    if isinstance(batch, torch.Tensor):
        return list(batch)
    if isinstance(batch, dict):
        return [dict(zip(batch, values, strict=True)) for values in zip(*map(unbatch, batch.values()), strict=True)]
    if isinstance(batch, list | tuple):
        return [type(batch)(values) for values in zip(*map(unbatch, batch), strict=True)]
    raise TypeError(
        f"predict_step returned a {type(batch).__name__}: return a tensor, or a dict, list or tuple of them"
    )


class PredictionWriter(BasePredictionWriter):
    """Writes the predictions of every process to ``predictions.pt``, one per input, in input order: a tensor with
    a row per input when the predictions are tensors of one shape, else a list.

    Each process predicts a shard; its (input index, prediction) pairs are gathered on global rank 0, put back in
    input order (the padding a distributed sampler adds falls away), written to a temporary file, then renamed.

    Args:
        output_path: the file to write; by default ``predictions.pt`` in the run's directory (the logger's).
    """

    suffix = ".pt"

    def __init__(self, output_path: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.output_path = output_path

    def rows(self, trainer: Trainer, predictions: Sequence[Any], batch_indices: Sequence[Any]) -> dict[int, Any]:
        """This process's predictions by input index."""
        (indices,) = batch_indices  # Lightning lists them by predict dataloader; the template's data has one
        return {
            index: row
            for batch, inputs in zip(predictions, indices, strict=True)
            for index, row in zip(inputs, unbatch(batch), strict=True)
        }

    def save(self, trainer: Trainer, rows: list[Any], file: Any) -> None:
        stackable = all(isinstance(row, torch.Tensor) and row.shape == rows[0].shape for row in rows)
        torch.save(torch.stack(rows).cpu() if stackable else rows, file)

    def write_on_epoch_end(
        self, trainer: Trainer, pl_module: LightningModule, predictions: Sequence[Any], batch_indices: Sequence[Any]
    ) -> None:
        # run_directory reads trainer.log_dir, a broadcast: every rank; a local path or an object store URL.
        path = self.output_path or f"{run_directory(trainer).rstrip('/')}/predictions{self.suffix}"
        local = self.rows(trainer, predictions, batch_indices)
        shards = [local]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            shards = [{} for _ in range(trainer.world_size)] if trainer.global_rank == 0 else None
            dist.gather_object(local, shards, dst=0)
        if trainer.global_rank != 0:
            return
        merged = {index: row for shard in shards for index, row in shard.items()}
        if sorted(merged) != list(range(len(merged))):
            raise RuntimeError(f"predictions cover {len(merged)} inputs, not inputs 0 to {len(merged) - 1}")
        rows = [merged[index] for index in range(len(merged))]
        if is_remote(path):
            with get_filesystem(path).open(path, "wb") as file:  # an object appears once its upload is complete
                self.save(trainer, rows, file)
        else:
            # Renamed into place, so a reader never sees half a file. A plain open gives it the permissions of the
            # run's other files (the umask's); a tempfile module file would stay 0600, unreadable to other users.
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            partial = Path(path).with_name(f".{Path(path).name}.partial")
            with open(partial, "wb") as file:
                self.save(trainer, rows, file)
            os.replace(partial, path)
        print(f"Wrote {len(merged)} predictions to {path}")


class Seq2SeqPredictionWriter(PredictionWriter):
    """Writes ``source<TAB>prediction`` lines to ``predictions.tsv``, in the order of ``data.predict_path``."""

    suffix = ".tsv"

    def rows(self, trainer: Trainer, predictions: Sequence[dict], batch_indices: Sequence[Any]) -> dict[int, str]:
        decode = trainer.datamodule.decode
        return {
            index: decode(tokens)
            for batch in predictions
            for index, tokens in zip(batch["index"].tolist(), batch["tokens"].tolist(), strict=True)
        }

    def save(self, trainer: Trainer, rows: list[str], file: Any) -> None:
        sources = trainer.datamodule.predict_sources
        if len(rows) != len(sources):
            raise RuntimeError(f"predictions cover {len(rows)} of {len(sources)} sources")
        file.write("".join(f"{source}\t{text}\n" for source, text in zip(sources, rows, strict=True)).encode())
