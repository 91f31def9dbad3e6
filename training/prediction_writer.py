"""What ``cli.py predict`` writes for the seq2seq example: one TSV file of sources and predictions, in input order."""

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter


class Seq2SeqPredictionWriter(BasePredictionWriter):
    """Writes ``source<TAB>prediction`` lines in the order of ``data.predict_path``, once, from global rank 0.

    Each rank predicts a shard; the (index, prediction) pairs are gathered on rank 0, put back in
    input order, and written to a temporary file that is then renamed to ``output_path``.

    Args:
        output_path: the TSV file to write.
    """

    def __init__(self, output_path: str = "predictions.tsv") -> None:
        super().__init__(write_interval="epoch")
        self.output_path = Path(output_path)

    def write_on_epoch_end(
        self, trainer: Trainer, pl_module: LightningModule, predictions: Sequence[dict], batch_indices: Sequence
    ) -> None:
        data = trainer.datamodule
        local = {
            index: data.decode(tokens)
            for batch in predictions
            for index, tokens in zip(batch["index"].tolist(), batch["tokens"].tolist(), strict=True)
        }
        shards = [local]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            shards = [{} for _ in range(trainer.world_size)] if trainer.global_rank == 0 else None
            dist.gather_object(local, shards, dst=0)
        if trainer.global_rank != 0:
            return
        merged = {index: text for shard in shards for index, text in shard.items()}
        sources = data.predict_sources
        if sorted(merged) != list(range(len(sources))):
            raise RuntimeError(f"predictions cover {len(merged)} of {len(sources)} sources")
        self.output_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=self.output_path.parent, delete=False) as tmp:
            tmp.writelines(f"{source}\t{merged[i]}\n" for i, source in enumerate(sources))
        os.replace(tmp.name, self.output_path)
        print(f"Wrote {len(sources)} predictions to {self.output_path}")
