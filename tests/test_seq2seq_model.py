"""The seq2seq Transformer: masks, greedy decoding, the LR schedule, learning a small batch by heart, and steps
that a GPU runs deterministically without waiting on the CPU."""

import inspect
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from data.seq2seq_batches import BOS, EOS, PAD, collate
from models import Seq2SeqTransformer, seq2seq
from models.seq2seq import sinusoidal_positions, warmup_then_inverse_sqrt
from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS, needs_gpus, run_script

SMALL = {"vocab_size": 12, "d_model": 32, "nhead": 2, "num_encoder_layers": 1, "num_decoder_layers": 1}
# On a GPU, reading a value back (int(), .item(), if on a tensor) makes the CPU wait for everything queued.
READ_BACK = "aten::_local_scalar_dense"


def tiny_model(**kwargs) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    return Seq2SeqTransformer(**{**SMALL, "dim_feedforward": 64, "dropout": 0.0, **kwargs}).eval()


def training_model() -> Seq2SeqTransformer:
    """A tiny model whose ``training_step`` runs without a Trainer: Lightning's logging is left out."""
    model = tiny_model(label_smoothing=0.1).train()
    model.log = lambda *args, **kwargs: None
    return model


def padded_batch() -> dict[str, torch.Tensor]:
    return collate([(0, [4, 5], [BOS, 7, EOS]), (1, [4, 5, 6, 7, 8], [BOS, 7, 8, 9, 10, EOS])])


def dispatched(run):
    """``run()``'s result and the names of the ATen operators it dispatched on the CPU, nested ones included."""
    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        result = run()
    return result, [event.name for event in recorded.events()]


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


@pytest.mark.parametrize("layout", ["whole", "sharded"])
def test_a_checkpoint_with_another_vocabulary_size_is_refused_with_the_reason(layout):
    trained = tiny_model(vocab_size=20)
    checkpoint = {"hyper_parameters": dict(trained.hparams), "epoch": 0, "global_step": 1}
    if layout == "whole":
        checkpoint["state_dict"] = trained.state_dict()
    # FSDP loads a sharded checkpoint's weights itself and gives the hook the rest (meta.pt): no state_dict.
    with pytest.raises(ValueError, match="trained with 20 tokens but this run's data gives model.vocab_size=12"):
        tiny_model().on_load_checkpoint(checkpoint)
    tiny_model(vocab_size=20).on_load_checkpoint(checkpoint)


def test_the_model_learns_a_small_batch_to_exact_match():
    # Reverse each sequence: the decoder has to attend across the whole source, position by position.
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randint(4, 12, (int(n),), generator=generator).tolist() for n in torch.randint(2, 7, (16,))]
    batch = collate([(i, s, [BOS, *s[::-1], EOS]) for i, s in enumerate(sources)])
    model = tiny_model(d_model=64, nhead=4, dim_feedforward=128).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    labels = batch["target"][:, 1:]
    for step in range(1, 81):  # exact after about 30 on the development machine; looked at every 10 steps
        logits = model(batch["source"], batch["source_padding_mask"], batch["target"], batch["target_padding_mask"])
        loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            decoded = model.eval().generate(batch["source"], batch["source_padding_mask"], max_length=labels.size(1))
            if torch.equal(decoded, labels):
                break
            model.train()
    model.eval()
    # Every row ends with the end token at its own length and padding after it, as the labels do.
    assert torch.equal(decoded, labels)
    capped = model.generate(batch["source"], batch["source_padding_mask"], max_length=3)
    assert torch.equal(capped, labels[:, :3])


def test_the_training_loss_runs_on_flat_logits_with_the_value_of_the_per_sequence_form():
    # On (batch, vocabulary, length) logits cross-entropy dispatches nll_loss2d, whose CUDA forward has no
    # deterministic version: trainer.deterministic would stop a GPU run at its first step.
    model, batch = training_model(), padded_batch()
    loss, ops = dispatched(lambda: model.training_step(batch, 0))
    assert "aten::nll_loss_forward" in ops and "aten::nll_loss2d_forward" not in ops
    logits = model(batch["source"], batch["source_padding_mask"], batch["target"], batch["target_padding_mask"])
    labels = batch["target"][:, 1:]
    per_sequence = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=PAD, label_smoothing=0.1)
    torch.testing.assert_close(loss, per_sequence)


def test_a_training_step_reads_nothing_back_and_decoding_only_its_stop_check():
    model, batch = training_model(), padded_batch()
    _, ops = dispatched(lambda: model.training_step(batch, 0).backward())
    assert READ_BACK not in ops
    model.eval()
    tokens, ops = dispatched(lambda: model.generate(batch["source"], batch["source_padding_mask"], max_length=6))
    # Once per token, whether every sequence has ended; position codes read nothing.
    assert ops.count(READ_BACK) == tokens.size(1)


def test_position_codes_are_the_rows_of_a_table_sized_by_the_largest_position():
    # The tables are sized from tensor shapes, no longer by the largest position; the codes must not change, so
    # trained checkpoints behave as before.
    table = sinusoidal_positions(512, 128, torch.device("cpu"))
    assert all(torch.equal(sinusoidal_positions(n, 128, torch.device("cpu")), table[:n]) for n in range(1, 512, 37))

    model, batch = tiny_model(), padded_batch()
    embedded = []
    model.dropout.register_forward_hook(lambda module, args, output: embedded.append(output))
    model(batch["source"], batch["source_padding_mask"], batch["target"], batch["target_padding_mask"])
    tokens = model.generate(batch["source"], batch["source_padding_mask"], max_length=6)

    def sized_by_largest_position(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        code = sinusoidal_positions(int(positions.max()) + 1, model.hparams.d_model, ids.device)
        return model.embedding(ids) + code[positions]

    lengths = (~batch["source_padding_mask"]).sum(dim=1, keepdim=True)
    source = sized_by_largest_position(
        batch["source"], (lengths - 1 - torch.arange(batch["source"].size(1))).clamp(min=0)
    )
    decoder_input = batch["target"][:, :-1]
    expected = [source, sized_by_largest_position(decoder_input, torch.arange(decoder_input.size(1))), source]
    inputs = torch.cat([torch.full((2, 1), BOS), tokens], dim=1)
    expected += [sized_by_largest_position(inputs[:, step : step + 1], torch.tensor([step])) for step in range(6)]
    assert len(embedded) == len(expected)
    assert all(torch.equal(got, want) for got, want in zip(embedded, expected, strict=True))


@needs_gpus(1)
def test_a_gpu_run_with_deterministic_algorithms_trains_and_validates(tmp_path):
    # A process of its own: deterministic algorithms are a process-wide setting, and torch reads
    # CUBLAS_WORKSPACE_CONFIG (which trainer.deterministic sets) at the first matrix product only.
    small = {"num_pairs": 330, "max_digits": 3, "val_fraction": 0.1, "batch_size": 16}
    result = run_script(
        [
            str(REPO / "cli.py"),
            "fit",
            "-c",
            DDP_YAML,
            "-c",
            str(REPO / "configs" / "seq2seq.yaml"),
            *SINGLE_PROCESS,
            *(f"--data.init_args.{key}={value}" for key, value in small.items()),
            "--model.init_args.d_model=32",
            "--model.init_args.label_smoothing=0.1",
            "--trainer.accelerator=gpu",
            "--trainer.deterministic=true",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert list((tmp_path / "logs").rglob("last.ckpt"))


@needs_gpus(1)
def test_on_a_gpu_no_line_of_the_model_waits_for_it_but_the_stop_check_of_decoding():
    model = training_model().cuda()
    batch = {name: tensor.cuda() for name, tensor in padded_batch().items()}
    model.training_step(batch, 0)  # CUDA's set-up on first use is not the model's to check
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.training_step(batch, 0)
    finally:
        torch.cuda.set_sync_debug_mode(before)
    # Decoding waits once per token to know whether every sequence has ended, so here waits are recorded, not
    # refused, and each is traced to the line of the model that waited.
    model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.generate(batch["source"], batch["source_padding_mask"], max_length=6)
        finally:
            torch.cuda.set_sync_debug_mode(before)
    lines, first = inspect.getsourcelines(Seq2SeqTransformer.generate)
    stop_check = first + next(i for i, line in enumerate(lines) if "done.all()" in line)
    waited = {
        w.lineno for w in caught if "synchronizing" in str(w.message) and Path(w.filename) == Path(seq2seq.__file__)
    }
    assert waited == {stop_check}
