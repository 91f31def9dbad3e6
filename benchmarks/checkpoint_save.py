"""How long training is blocked by saving a checkpoint: written in the step (``background: false``) against written
by a thread (``background: true``, configs/ddp.yaml), through the template's AtomicCheckpointIO.

    python -m benchmarks.checkpoint_save                  # 4096x4096 linear layers and AdamW: 576 MiB of state
    python -m benchmarks.checkpoint_save --megabytes 8 --rounds 1   # a look at the plumbing

Each round saves the model's state dict and an optimizer step's AdamW state, as a training step's checkpoint
holds them, once each way, the two ways taking turns to go first; each way keeps one AtomicCheckpointIO for all
its saves, as a run does. "Blocked" is the time ``save_checkpoint`` takes, which is when the training loop
waits; "written" is the time until the file is complete and synced to disk. The first save is shown apart: the
background's copy goes to fresh memory then, and to the memory of the previous copy in every later save.
"""

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from training.checkpoints.atomic_io import AtomicCheckpointIO

GOAL = 0.20  # the most the background may block, as a share of the synchronous save


def build(megabytes: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear layers (4096x4096 unless ``megabytes`` is small) whose weights and AdamW state hold ``megabytes``."""
    width = 4096 if megabytes >= 192 else 256
    per_layer = width * (width + 1) * 4 * 3 / 2**20  # float32 weights and bias, exp_avg, exp_avg_sq
    model = torch.nn.Sequential(
        *(torch.nn.Linear(width, width) for _ in range(max(1, math.ceil(megabytes / per_layer))))
    )
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=512, help="state to save, at least (default 512)")
    parser.add_argument("--rounds", type=int, default=5, help="saves each way, the first included (default 5)")
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temporary directory)")
    args = parser.parse_args(argv)
    model, optimizer = build(args.megabytes)
    tensors = [*model.state_dict().values(), *(t for s in optimizer.state.values() for t in s.values())]
    size = sum(t.numel() * t.element_size() for t in tensors if t.dim()) / 2**20
    print(f"checkpoint of {size:.0f} MiB of tensors, {args.rounds} saves each way", flush=True)
    ways = {"in the step": AtomicCheckpointIO(background=False), "background": AtomicCheckpointIO(background=True)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for step in range(args.rounds):
            for name in ways if step % 2 == 0 else reversed(ways):
                checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}
                start = time.perf_counter()
                ways[name].save_checkpoint({**checkpoint, "global_step": step}, Path(directory) / f"{name}.ckpt")
                blocked = time.perf_counter() - start
                ways[name].wait()  # what the next save of a later step waits for
                times[name].append((blocked, time.perf_counter() - start))
            print(f"  save {step + 1} of {args.rounds} done both ways", flush=True)
        for io in ways.values():
            io.teardown()
    result: dict = {"MiB": round(size)}
    for name in ways:
        first, later = times[name][0], times[name][1:] or times[name]
        result[name] = {
            "first_blocked_s": first[0],
            "blocked_s": statistics.median(t[0] for t in later),
            "written_s": statistics.median(t[1] for t in later),
        }
        print(
            f"{name:>12}: training blocked {result[name]['blocked_s']:6.3f} s (the first save {first[0]:6.3f} s), "
            f"checkpoint written after {result[name]['written_s']:6.3f} s (medians of the later saves)"
        )
    ratio = result["background"]["blocked_s"] / result["in the step"]["blocked_s"]
    result["ratio"] = ratio
    first_ratio = result["background"]["first_blocked_s"] / result["in the step"]["first_blocked_s"]
    verdict = "met" if ratio <= GOAL else "NOT met"
    print(
        f"background/in-the-step blocked time: {ratio:.3f} (goal at most {GOAL:.2f}: {verdict}); "
        f"the first save {first_ratio:.3f}"
    )
    return result


if __name__ == "__main__":
    main()
