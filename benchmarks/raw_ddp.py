"""The hand-written DDP loop the template is held against: the same model, data, batches, seed and threads.

    python -m benchmarks.raw_ddp --workload toy --processes 2 --steps 60 --out raw.json [--quick] [--data-dir DIR]
        [--accelerator gpu]

The model and the data module come from the workload's configs through the CLI's own parser (so the
same classes, sizes and optimizer), without Lightning's Trainer: DistributedDataParallel over gloo, a
DistributedSampler with the seed Lightning gives its own, ``cores / processes`` threads as Lightning sets
them, and the DataLoader settings (workers, pinned memory) the data module picks for the device. With
``--accelerator gpu``, NCCL and one GPU per process, each batch copied to it as Lightning copies one. One
process trains in the command's own process, as Lightning trains one device. Every rank marks the start of each
step with benchmarks/timing.py's StepMarks (a CUDA event on a GPU: no wait within the steps); rank 0 writes them
and, beside the JSON file, the trained weights, as a template run does.
"""

import argparse
import gc
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
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.timing import StepMarks, write_record
from benchmarks.workloads import SEED, WORKLOADS, build, run_arguments
from data.length_sampler import LengthGroupedBatchSampler


def placement(accelerator: str, local_rank: int) -> tuple[str, torch.device]:
    """The process group's backend and the device of the process with ``local_rank``."""
    if accelerator == "gpu":
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def like(template: DataLoader, **sampling) -> DataLoader:
    """A DataLoader of the template's dataset, collate, workers and pinned memory, sampled the raw loop's way."""
    return DataLoader(
        template.dataset,
        collate_fn=template.collate_fn,
        num_workers=template.num_workers,
        persistent_workers=template.persistent_workers,
        pin_memory=template.pin_memory,
        **sampling,
    )


def toy_loader(data, rank: int, world: int) -> tuple[DataLoader, DistributedSampler]:
    template = data.train_dataloader()
    sampler = DistributedSampler(template.dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    return like(template, batch_size=data.batch_size, sampler=sampler), sampler


def seq2seq_loader(data, rank: int, world: int) -> tuple[DataLoader, DistributedSampler]:
    template = data.train_dataloader()
    dataset = template.dataset
    lengths = [len(s) + len(t) for s, t in zip(dataset.sources, dataset.targets, strict=True)]
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    batches = LengthGroupedBatchSampler(sampler, data.hparams.batch_size, False, lengths)
    return like(template, batch_sampler=batches), sampler


def to_device(batch, device: torch.device):
    """The batch on ``device``; non-blocking, as Lightning copies a batch to a GPU."""
    if isinstance(batch, dict):
        return {key: value.to(device, non_blocking=True) for key, value in batch.items()}
    return [tensor.to(device, non_blocking=True) for tensor in batch]


def toy_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def seq2seq_loss(model, batch) -> torch.Tensor:
    """The training loss of models/seq2seq.py, in the same shapes: another order of the sums parts the weights."""
    logits = model(batch["source"], batch["source_padding_mask"], batch["target"], batch["target_padding_mask"])
    module = model.module
    return F.cross_entropy(
        logits.flatten(0, 1),
        batch["target"][:, 1:].flatten(),
        ignore_index=module.hparams.pad_id,
        label_smoothing=module.hparams.label_smoothing,
    )


def timed_steps(model, device, loader, sampler, loss_of, optimizer, scheduler, steps: int) -> tuple[list, float, list]:
    """``steps`` steps of ``model`` under DistributedDataParallel: when each step started, the wall time of the
    first, and the process's CPU time at each start. The wrapper lives in here only: it is freed on return, before
    the process group (release_group)."""
    on_gpu = device.type == "cuda"
    ddp = DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None, gradient_as_bucket_view=True)
    marks, cpu_starts = StepMarks(device), []
    first_step_wall = 0.0
    epoch = 0
    while len(marks) < steps:
        sampler.set_epoch(epoch)  # as Lightning does at each epoch start
        for batch in itertools.islice(loader, steps - len(marks)):
            if not marks:
                first_step_wall = time.time()
            marks.mark()
            cpu_starts.append(time.process_time())
            optimizer.zero_grad(set_to_none=True)
            loss_of(ddp, to_device(batch, device)).backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        epoch += 1
    return marks.seconds(), first_step_wall, cpu_starts


def release_group() -> None:
    """Destroy the process group once nothing else holds it. A DDP wrapper freed after the group (its Reducer holds
    the group) drops the group's last reference with the GIL held, and the group's destructor waits for its worker
    thread, which needs the GIL to free a finished all-reduce: both processes hung at exit (torch #56297)."""
    gc.collect()  # a wrapper in a reference cycle: freed now, while the group is still registered
    dist.barrier()  # every rank's last collective done
    dist.destroy_process_group()


def train(rank: int, args: argparse.Namespace) -> None:
    world = args.processes
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    backend, device = placement(args.accelerator, rank)  # one node: the global rank is the local rank
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=world,
        device_id=device if on_gpu else None,  # NCCL connects at once, as Lightning starts it
    )
    arguments = WORKLOADS[args.workload].arguments(args.quick, Path(args.data_dir), args.accelerator)
    # seed_everything from the config, then the classes: the model's initial weights match a template run's.
    built = build([*arguments, f"--trainer.devices={world}"])
    model, data = built.model.to(device), built.datamodule
    # The trainer of the same config, on the same devices, from which the data module picks its loaders' workers
    # and pinned memory.
    data.trainer = built.trainer
    data.prepare_data()
    data.setup("fit")
    torch.manual_seed(SEED)  # Lightning seeds again when it sets up the process group
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    scheduler = configured["lr_scheduler"]["scheduler"] if isinstance(configured, dict) else None
    loader, sampler = (seq2seq_loader if args.workload == "seq2seq" else toy_loader)(data, rank, world)
    loss_of = seq2seq_loss if args.workload == "seq2seq" else toy_loss
    starts, first_step_wall, cpu_starts = timed_steps(
        model, device, loader, sampler, loss_of, optimizer, scheduler, args.steps
    )
    if rank == 0:
        write_record(Path(args.out), starts, first_step_wall, torch.get_num_threads(), model, cpu_starts)
    release_group()


def main() -> None:
    args = run_arguments(__doc__)
    args.port = find_free_network_port()
    if args.processes == 1:
        # This process trains: a spawned one would import torch again, seconds of every run of the benchmark's
        # short mode on one GPU (benchmarks/short.py).
        train(0, args)
        return
    # Forked, the processes start with everything imported: start-up is not what this script times. On GPUs they
    # start afresh: counting the GPUs may have initialised CUDA, which a forked process cannot use.
    start_method = "spawn" if args.accelerator == "gpu" else "fork"
    mp.start_processes(train, args=(args,), nprocs=args.processes, start_method=start_method)


if __name__ == "__main__":
    main()
