"""The hand-written DDP loop the template is held against: the same model, data, batches, seed and threads.

    python -m benchmarks.raw_ddp --workload toy --processes 2 --steps 60 --out raw.json [--quick] [--data-dir DIR]

The model and the data module come from the workload's configs through the CLI's own parser (so the
same classes, sizes and optimizer), without Lightning's Trainer: DistributedDataParallel over gloo, a
DistributedSampler with the seed Lightning gives its own, ``cores / processes`` threads as Lightning sets
them. Rank 0 writes when each step started and, beside the JSON file, the trained weights, as
benchmarks/timing.py does for a template run.
"""

import argparse
import itertools
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, default_convert

from benchmarks.timing import write_record
from benchmarks.workloads import SEED, WORKLOADS, build, run_parser
from data.length_sampler import LengthGroupedBatchSampler
from data.seq2seq import collate


def toy_loader(data, rank: int, world: int) -> tuple[DataLoader, DistributedSampler]:
    dataset = data.splits["train"]
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    return DataLoader(dataset, batch_size=data.batch_size, sampler=sampler, collate_fn=default_convert), sampler


def seq2seq_loader(data, rank: int, world: int) -> tuple[DataLoader, DistributedSampler]:
    dataset = data.train_dataloader().dataset
    lengths = [len(s) + len(t) for s, t in zip(dataset.sources, dataset.targets, strict=True)]
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    batches = LengthGroupedBatchSampler(sampler, data.hparams.batch_size, False, lengths)
    return DataLoader(dataset, batch_sampler=batches, collate_fn=collate), sampler


def toy_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def seq2seq_loss(model, batch) -> torch.Tensor:
    logits = model(batch["source"], batch["source_padding_mask"], batch["target"], batch["target_padding_mask"])
    module = model.module
    return F.cross_entropy(
        logits.transpose(1, 2),
        batch["target"][:, 1:],
        ignore_index=module.hparams.pad_id,
        label_smoothing=module.hparams.label_smoothing,
    )


def train(rank: int, args: argparse.Namespace) -> None:
    world = args.processes
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    arguments = WORKLOADS[args.workload].arguments(args.quick, Path(args.data_dir))
    # seed_everything from the config, then the classes: the model's initial weights match a template run's.
    built = build([*arguments, f"--trainer.devices={world}"])
    model, data = built.model, built.datamodule
    data.prepare_data()
    data.setup("fit")
    torch.manual_seed(SEED)  # Lightning seeds again when it sets up the process group
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    scheduler = configured["lr_scheduler"]["scheduler"] if isinstance(configured, dict) else None
    loader, sampler = (toy_loader if args.workload == "toy" else seq2seq_loader)(data, rank, world)
    loss_of = toy_loss if args.workload == "toy" else seq2seq_loss

    starts = []
    first_step_wall = 0.0
    epoch = 0
    while len(starts) < args.steps:
        sampler.set_epoch(epoch)  # as Lightning does at each epoch start
        for batch in itertools.islice(loader, args.steps - len(starts)):
            if not starts:
                first_step_wall = time.time()
            starts.append(time.perf_counter())
            optimizer.zero_grad(set_to_none=True)
            loss_of(ddp, batch).backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        epoch += 1
    if rank == 0:
        write_record(Path(args.out), starts, first_step_wall, torch.get_num_threads(), model)
    dist.destroy_process_group()


def main() -> None:
    args = run_parser(__doc__).parse_args()
    args.port = find_free_network_port()
    # Forked, the processes start with everything imported: start-up is not what this script times.
    mp.start_processes(train, args=(args,), nprocs=args.processes, start_method="fork")


if __name__ == "__main__":
    main()
