"""Training throughput of the seq2seq example: with and without length-grouped batches, and streamed from shards.

    python -m benchmarks.seq2seq_tokens [--steps 40] [--repeats 3] [--batch-size 64] [--threads 1]

Trains the model of configs/seq2seq.yaml on the built-in corpus in one process (by default with one
thread, what each of 2 DDP processes gets on a 2-core machine), in turn from memory with length-grouped
batches, from memory shuffled, and from the corpus converted by scripts/make_shards.py (grouped), and prints
the median tokens/s of each. Reading the data is part of every step. Tokens are the non-padding source and
target tokens; the padding each batching adds is computed but not counted.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from data import Seq2SeqDataModule
from models import Seq2SeqTransformer
from scripts import make_shards

REPO = Path(__file__).resolve().parents[1]


def example_settings() -> tuple[dict, dict, float]:
    """Model and data init args and learning rate of configs/seq2seq.yaml."""
    config = yaml.safe_load((REPO / "configs" / "seq2seq.yaml").read_text())
    model = dict(config["model"]["init_args"])
    lr = model.pop("optimizer")["init_args"]["lr"]
    return model, dict(config["data"]["init_args"]), lr


def tokens_per_second(data: Seq2SeqDataModule, model: Seq2SeqTransformer, lr: float, steps: int) -> dict[str, float]:
    """Run ``steps`` training steps on ``data``'s training loader; return tokens/s, s/step and the padding share."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batches = iter(data.train_dataloader())
    tokens = padding = 0
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(batches)
        logits = model(batch["source"], batch["source_padding_mask"], batch["target"], batch["target_padding_mask"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["target"][:, 1:].flatten(), ignore_index=data.pad_id)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        masks = (batch["source_padding_mask"], batch["target_padding_mask"])
        tokens += sum(int((~mask).sum()) for mask in masks)
        padding += sum(int(mask.sum()) for mask in masks)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": tokens / seconds, "s_per_step": seconds / steps, "padding": padding / (tokens + padding)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="training steps per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None, help="default: data.batch_size of the config")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_args, data_args, lr = example_settings()
    data_args.pop("path")
    if args.batch_size:
        data_args["batch_size"] = args.batch_size
    with tempfile.TemporaryDirectory() as data_dir:
        data = Seq2SeqDataModule(**data_args, data_dir=data_dir)
        data.prepare_data()
        data.setup("fit")
        shards = Path(data_dir) / "shards"
        split = [f"--val-fraction={data_args['val_fraction']}", f"--seed={data.hparams.seed}"]
        if make_shards.main([str(data.corpus_path), str(shards), *split]) != 0:
            raise SystemExit("make_shards.py could not convert the built-in corpus")
        streamed = Seq2SeqDataModule(**{**data_args, "path": str(shards)})
        model = Seq2SeqTransformer(**model_args, vocab_size=data.vocab_size)
        variants = {"grouped by length": (data, True), "shuffled": (data, False), "shards, grouped": (streamed, True)}
        results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        tokens_per_second(data, model, lr, steps=5)  # warm-up
        for _ in range(args.repeats):
            for name, (source, grouped) in variants.items():
                source.hparams.group_by_length = grouped
                results[name].append(tokens_per_second(source, model, lr, args.steps))

    print(
        f"batch size {data.hparams.batch_size}, {args.threads} thread(s), "
        f"median of {args.repeats} x {args.steps} training steps"
    )
    medians = {
        name: {key: statistics.median(run[key] for run in runs) for key in runs[0]} for name, runs in results.items()
    }
    for name, median in medians.items():
        print(
            f"{name:>17}: {median['tokens_per_s']:7.0f} tokens/s, "
            f"{median['s_per_step'] * 1e3:4.0f} ms/step, {median['padding']:.0%} of each batch is padding"
        )
    ratio = medians["shards, grouped"]["tokens_per_s"] / medians["grouped by length"]["tokens_per_s"]
    print(f"shards / memory (both grouped): {ratio:.2f}x tokens/s")


if __name__ == "__main__":
    main()
