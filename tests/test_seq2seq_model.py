"""The seq2seq Transformer: masks, greedy decoding, the LR schedule, and learning a small batch by heart."""

import pytest
import torch
import torch.nn.functional as F

from data.seq2seq import BOS, EOS, PAD, collate
from models import Seq2SeqTransformer
from models.seq2seq import warmup_then_inverse_sqrt

SMALL = {"vocab_size": 12, "d_model": 32, "nhead": 2, "num_encoder_layers": 1, "num_decoder_layers": 1}


def tiny_model(**kwargs) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    return Seq2SeqTransformer(**{**SMALL, "dim_feedforward": 64, "dropout": 0.0, **kwargs}).eval()


def test_a_target_position_does_not_see_later_positions():
    model = tiny_model()
    source, mask = torch.tensor([[4, 5, 6]]), torch.zeros(1, 3, dtype=torch.bool)
    target = torch.tensor([[BOS, 7, 8, 9, EOS]])
    changed = target.clone()
    changed[0, 3] = 10
    no_padding = torch.zeros_like(target, dtype=torch.bool)
    logits, logits_changed = model(source, mask, target, no_padding), model(source, mask, changed, no_padding)
    assert torch.allclose(logits[0, :3], logits_changed[0, :3], atol=1e-6)  # positions before the change
    assert not torch.allclose(logits[0, 3], logits_changed[0, 3], atol=1e-3)


def test_padding_changes_nothing():
    model = tiny_model()
    alone = collate([(0, [4, 5], [BOS, 7, EOS])])
    padded = collate([(0, [4, 5], [BOS, 7, EOS]), (1, [4, 5, 6, 7, 8], [BOS, 7, 8, 9, 10, EOS])])
    logits_alone = model(alone["source"], alone["source_padding_mask"], alone["target"], alone["target_padding_mask"])
    logits_padded = model(
        padded["source"], padded["source_padding_mask"], padded["target"], padded["target_padding_mask"]
    )
    assert torch.allclose(logits_alone[0], logits_padded[0, :2], atol=1e-5)
    decoded_alone = model.generate(alone["source"], alone["source_padding_mask"], max_length=6)
    decoded_padded = model.generate(padded["source"], padded["source_padding_mask"], max_length=6)
    assert torch.equal(decoded_alone[0], decoded_padded[0, : decoded_alone.size(1)])


def test_step_by_step_decoding_on_cached_keys_gives_what_the_full_decoder_predicts():
    model = tiny_model()
    batch = collate([(i, [4 + i % 6] * (1 + i % 4), None) for i in range(8)])
    tokens = model.generate(batch["source"], batch["source_padding_mask"], max_length=6)
    assert tokens.size(1) == 6  # an untrained model rarely ends, so every step is compared
    target = torch.cat([torch.full((8, 1), BOS), tokens], dim=1)
    logits = model(batch["source"], batch["source_padding_mask"], target, torch.zeros_like(target, dtype=torch.bool))
    ended_before = torch.cat([torch.zeros(8, 1, dtype=torch.bool), (tokens == EOS).cumsum(1)[:, :-1] > 0], dim=1)
    assert torch.equal(logits.argmax(-1)[~ended_before], tokens[~ended_before])


def test_warmup_rises_linearly_then_decays():
    factors = [warmup_then_inverse_sqrt(step, warmup_steps=10) for step in range(40)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[9] == 1.0 and factors[39] == pytest.approx(0.5)
    assert all(a > b for a, b in zip(factors[9:], factors[10:], strict=False))


def test_a_checkpoint_with_another_vocabulary_size_is_refused_with_the_reason():
    checkpoint = {"state_dict": tiny_model(vocab_size=20).state_dict()}
    with pytest.raises(ValueError, match="trained with 20 tokens but this run's data gives model.vocab_size=12"):
        tiny_model().on_load_checkpoint(checkpoint)


def test_the_model_learns_a_small_batch_to_exact_match():
    # Reverse each sequence: the decoder has to attend across the whole source, position by position.
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randint(4, 12, (int(n),), generator=generator).tolist() for n in torch.randint(2, 7, (16,))]
    batch = collate([(i, s, [BOS, *s[::-1], EOS]) for i, s in enumerate(sources)])
    model = tiny_model(d_model=64, nhead=4, dim_feedforward=128).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    labels = batch["target"][:, 1:]
    for _ in range(80):  # exact after about 30 on the development machine
        logits = model(batch["source"], batch["source_padding_mask"], batch["target"], batch["target_padding_mask"])
        loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    decoded = model.generate(batch["source"], batch["source_padding_mask"], max_length=labels.size(1))
    # Every row ends with the end token at its own length and padding after it, as the labels do.
    assert torch.equal(decoded, labels)
    capped = model.generate(batch["source"], batch["source_padding_mask"], max_length=3)
    assert torch.equal(capped, labels[:, :3])
