"""A small Transformer encoder-decoder trained with teacher forcing and decoded greedily."""

import math
from functools import partial

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from torch import nn
from torchmetrics import MeanMetric


def sinusoidal_positions(length: int, width: int, device: torch.device) -> torch.Tensor:
    """The fixed position code of "Attention Is All You Need": no length limit, nothing to learn or broadcast."""
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, width, 2, device=device) * (-math.log(10000.0) / width))
    code = torch.zeros(length, width, device=device)
    code[:, 0::2] = torch.sin(position * frequency)
    code[:, 1::2] = torch.cos(position * frequency)
    return code


def warmup_then_inverse_sqrt(step: int, warmup_steps: int) -> float:
    """LR factor: linear from ~0 to 1 over ``warmup_steps``, then decaying as ``1 / sqrt(step)``."""
    step += 1
    return min(step / warmup_steps, math.sqrt(warmup_steps / step))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer (self-attention, cross-attention, feed-forward) that can also run one position at
    a time on cached keys and values, so greedy decoding costs one position per step instead of the whole prefix.
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, dropout: float) -> None:
        super().__init__()
        self.nhead = nhead
        self.attention_dropout = dropout
        self.self_norm, self.cross_norm, self.ff_norm = (nn.LayerNorm(d_model) for _ in range(3))
        self.self_qkv = nn.Linear(d_model, 3 * d_model)
        self.self_out = nn.Linear(d_model, d_model)
        self.cross_q = nn.Linear(d_model, d_model)
        self.cross_kv = nn.Linear(d_model, 2 * d_model)
        self.cross_out = nn.Linear(d_model, d_model)
        self.feedforward = nn.Sequential(
            nn.Linear(d_model, dim_feedforward), nn.ReLU(), nn.Dropout(dropout), nn.Linear(dim_feedforward, d_model)
        )
        self.dropout = nn.Dropout(dropout)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, length, d_model) -> (batch, nhead, length, d_model / nhead)``."""
        return x.unflatten(-1, (self.nhead, -1)).transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        p = self.attention_dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p).transpose(1, 2).flatten(2)

    def memory_keys_values(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values of the encoder output, computed once per batch."""
        keys, values = self.cross_kv(memory).chunk(2, dim=-1)
        return self.heads(keys), self.heads(values)

    def forward(
        self,
        x: torch.Tensor,
        memory: tuple[torch.Tensor, torch.Tensor],
        memory_mask: torch.Tensor,
        self_mask: torch.Tensor | None = None,
        cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Returns the new hidden states and the self-attention keys and values so far (the next step's cache).

        Masks are boolean, True where attention is allowed. With ``cache``, ``x`` holds only the newest
        position, which may attend to everything cached.
        """
        q, k, v = (self.heads(part) for part in self.self_qkv(self.self_norm(x)).chunk(3, dim=-1))
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        x = x + self.dropout(self.self_out(self.attend(q, k, v, self_mask)))
        cross = self.attend(self.heads(self.cross_q(self.cross_norm(x))), *memory, memory_mask)
        x = x + self.dropout(self.cross_out(cross))
        x = x + self.dropout(self.feedforward(self.ff_norm(x)))
        return x, (k, v)


class Seq2SeqTransformer(LightningModule):
    """Pre-norm Transformer encoder-decoder over one shared token vocabulary.

    Batches are the dicts of :class:`data.Seq2SeqDataModule`: ``source``/``target`` token ids padded
    with ``pad_id`` and their ``*_padding_mask`` (True on padding); targets start with ``bos_id`` and
    end with ``eos_id``.

    Args:
        vocab_size: tokens in the vocabulary. cli.py links it, and the special ids, from the data.
        pad_id: padding token, ignored by attention and by the loss.
        bos_id: start token, the first decoder input.
        eos_id: end token; greedy decoding stops once every sequence has produced it.
        d_model: width of embeddings and hidden states.
        nhead: attention heads.
        num_encoder_layers: encoder layers.
        num_decoder_layers: decoder layers.
        dim_feedforward: hidden width of the feed-forward blocks.
        dropout: dropout in attention, feed-forward and embeddings.
        label_smoothing: share of the target probability spread over the vocabulary in the training loss.
        warmup_steps: optimizer steps of linear LR warm-up, followed by ``1/sqrt(step)`` decay.
        max_decode_length: cap on generated tokens (end token included) in ``predict_step``.
        optimizer: optimizer class and arguments, e.g. ``{class_path: torch.optim.AdamW, init_args: {lr: 0.001}}``.
    """

    def __init__(
        self,
        vocab_size: int = 32,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        d_model: int = 128,
        nhead: int = 4,
        num_encoder_layers: int = 2,
        num_decoder_layers: int = 2,
        dim_feedforward: int = 256,
        dropout: float = 0.0,
        label_smoothing: float = 0.0,
        warmup_steps: int = 200,
        max_decode_length: int = 128,
        optimizer: OptimizerCallable = torch.optim.AdamW,
    ) -> None:
        super().__init__()
        if d_model % nhead or d_model % 2:
            raise ValueError(f"model.d_model={d_model} must be even and divisible by model.nhead={nhead}")
        for name in ("warmup_steps", "max_decode_length"):
            if locals()[name] < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {locals()[name]}")
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"model.label_smoothing must be in [0, 1), got {label_smoothing}")
        self.save_hyperparameters()
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.dropout = nn.Dropout(dropout)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, batch_first=True, norm_first=True),
            num_encoder_layers,
            norm=nn.LayerNorm(d_model),
            enable_nested_tensor=False,  # not supported with norm_first; saves a warning
        )
        self.decoder = nn.ModuleList(
            DecoderLayer(d_model, nhead, dim_feedforward, dropout) for _ in range(num_decoder_layers)
        )
        self.decoder_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.optimizer = optimizer
        # Sums over every rank's tokens and sequences (torchmetrics syncs the states), not means of rank means.
        self.val_metrics = nn.ModuleDict({name: MeanMetric() for name in ("loss", "token_acc", "exact_match")})

    def embed(self, ids: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Token embeddings plus position codes ``codes`` (rows of :func:`sinusoidal_positions`, broadcastable to
        the embeddings). Callers size the code table from tensor shapes: sizing it from the positions' values
        would make the CPU wait for the GPU on every call."""
        return self.dropout(self.embedding(ids) + codes)

    def encode(self, source: torch.Tensor, source_padding_mask: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Each decoder layer's cross-attention keys and values of the source."""
        # The encoder reads the whole source at once, so its positions can count from either end. Counted back
        # from the end, the last characters (a number's units, a word's ending) sit at the same positions in
        # every source, whatever its length.
        lengths = (~source_padding_mask).sum(dim=1, keepdim=True)
        positions = (lengths - 1 - torch.arange(source.size(1), device=source.device)).clamp(min=0)
        codes = sinusoidal_positions(source.size(1), self.hparams.d_model, source.device)[positions]
        memory = self.encoder(self.embed(source, codes), src_key_padding_mask=source_padding_mask)
        return [layer.memory_keys_values(memory) for layer in self.decoder]

    def forward(
        self,
        source: torch.Tensor,
        source_padding_mask: torch.Tensor,
        target: torch.Tensor,
        target_padding_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Teacher forcing: logits for ``target[:, 1:]`` given ``target[:, :-1]``, each position seeing only those
        before it and no padding."""
        memory, memory_mask = self.encode(source, source_padding_mask), ~source_padding_mask[:, None, None, :]
        length = target.size(1) - 1
        causal = torch.ones(length, length, dtype=torch.bool, device=target.device).tril()
        self_mask = causal & ~target_padding_mask[:, None, None, :-1]
        hidden = self.embed(target[:, :-1], sinusoidal_positions(length, self.hparams.d_model, target.device))
        for layer, layer_memory in zip(self.decoder, memory, strict=True):
            hidden, _ = layer(hidden, layer_memory, memory_mask, self_mask)
        return self.head(self.decoder_norm(hidden))

    @torch.no_grad()
    def generate(self, source: torch.Tensor, source_padding_mask: torch.Tensor, max_length: int) -> torch.Tensor:
        """Greedy decoding of a batch: ``(batch, <= max_length)`` token ids, padding after each end token."""
        memory, memory_mask = self.encode(source, source_padding_mask), ~source_padding_mask[:, None, None, :]
        caches = [None] * len(self.decoder)
        token = torch.full((len(source), 1), self.hparams.bos_id, dtype=torch.long, device=source.device)
        done = torch.zeros(len(source), dtype=torch.bool, device=source.device)
        codes = sinusoidal_positions(max_length, self.hparams.d_model, source.device)
        generated = []
        for step in range(max_length):
            hidden = self.embed(token, codes[step])
            for i, (layer, layer_memory) in enumerate(zip(self.decoder, memory, strict=True)):
                hidden, caches[i] = layer(hidden, layer_memory, memory_mask, cache=caches[i])
            token = self.head(self.decoder_norm(hidden)).argmax(-1).masked_fill(done[:, None], self.hparams.pad_id)
            generated.append(token)
            done |= token[:, 0] == self.hparams.eos_id
            if done.all():
                break
        return torch.cat(generated, dim=1)

    def _shared_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        logits = self(batch["source"], batch["source_padding_mask"], batch["target"], batch["target_padding_mask"])
        labels = batch["target"][:, 1:]
        # Validation loss is plain cross-entropy, comparable whatever the label smoothing.
        smoothing = self.hparams.label_smoothing if stage == "train" else 0.0
        # Flat (tokens, vocabulary) logits: on 3-D logits cross-entropy runs nll_loss2d, whose CUDA kernel has no
        # deterministic version, so trainer.deterministic would stop the run.
        loss = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=self.hparams.pad_id, label_smoothing=smoothing
        )
        if stage == "train":
            self.log("train/loss", loss, prog_bar=True)
            return loss
        real = ~batch["target_padding_mask"][:, 1:]
        tokens = real.sum()
        predicted = self.generate(batch["source"], batch["source_padding_mask"], max_length=labels.size(1))
        predicted = F.pad(predicted, (0, labels.size(1) - predicted.size(1)), value=self.hparams.pad_id)
        metrics = self.val_metrics
        metrics["loss"].update(loss, weight=tokens)
        metrics["token_acc"].update(((logits.argmax(-1) == labels) & real).sum() / tokens, weight=tokens)
        metrics["exact_match"].update((predicted == labels).all(dim=1).float())
        for name, metric in metrics.items():
            self.log(f"{stage}/{name}", metric, prog_bar=name != "token_acc")
        return loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        tokens = self.generate(batch["source"], batch["source_padding_mask"], self.hparams.max_decode_length)
        return {"index": batch["index"], "tokens": tokens}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # The hyperparameters, not the weights: a sharded (FSDP) checkpoint hands this hook its metadata alone.
        rows = checkpoint[self.CHECKPOINT_HYPER_PARAMS_KEY]["vocab_size"]
        if rows != self.hparams.vocab_size:
            raise ValueError(
                f"the checkpoint was trained with {rows} tokens but this run's data gives model.vocab_size="
                f"{self.hparams.vocab_size}: use the data the checkpoint was trained on, e.g. "
                "-c logs/<name>/<run id>/config.yaml of the training run"
            )

    def configure_optimizers(self) -> dict:
        optimizer = self.optimizer(self.parameters())
        schedule = partial(warmup_then_inverse_sqrt, warmup_steps=self.hparams.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
