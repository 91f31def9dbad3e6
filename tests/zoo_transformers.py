"""A language model written the way transformers' users write one, beside tests/zoo.py so that only the processes
that use it import transformers (about 2 s of CPU each): GPT-2 built from a ``GPT2Config`` (random weights, tiny
sizes), its loss taken from the model's own output, AdamW without weight decay on biases and LayerNorms, and
transformers' linear warm-up schedule stepped every step over the run's total steps."""

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup


class Counting(LightningDataModule):
    """Sequences that count up modulo ``vocab_size`` from a random start: the next token is always the last plus one.
    Every split has its own seeded starts; predict gives the model the sequences without their last token."""

    def __init__(self, vocab_size: int = 64, length: int = 16, batch_size: int = 8, num_test: int = 11) -> None:
        super().__init__()
        self.save_hyperparameters()

    def split(self, size: int, seed: int) -> torch.Tensor:
        starts = torch.randint(self.hparams.vocab_size, (size, 1), generator=torch.Generator().manual_seed(seed))
        return (starts + torch.arange(self.hparams.length)) % self.hparams.vocab_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.split(64, 0), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.split(16, 1), batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.split(self.hparams.num_test, 2), batch_size=4)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.split(10, 3)[:, :-1], batch_size=4)


class TinyGPT(LightningModule):
    def __init__(self, vocab_size: int = 64, n_embd: int = 32, n_layer: int = 2, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = GPT2Config(vocab_size=vocab_size, n_positions=32, n_embd=n_embd, n_layer=n_layer, n_head=2)
        config.bos_token_id = config.eos_token_id = 0
        self.model = GPT2LMHeadModel(config)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, labels=tokens).loss

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(tokens)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, tokens: torch.Tensor, batch_idx: int) -> None:
        self.log("val/loss", self.loss(tokens), sync_dist=True)

    def test_step(self, tokens: torch.Tensor, batch_idx: int) -> None:
        self.log("test/loss", self.loss(tokens), sync_dist=True)

    def predict_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=tokens).logits[:, -1].argmax(-1)  # the next token

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]  # biases and LayerNorms: one dimension
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr)
        total = self.trainer.estimated_stepping_batches
        scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
