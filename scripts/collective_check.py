"""The doctor's check of the collectives data-parallel training uses, each on small tensors of known result."""

import torch
import torch.distributed as dist


def ring(rank: int, world: int, device: torch.device) -> torch.Tensor:
    """Send this rank's number to the next rank and receive the previous rank's: what arrived.

    Send and receive go as one batch. NCCL runs a lone send or receive as an operation of its own, in order on
    the device, and a send completes only once its peer receives: were every rank to send before it
    receives, each would wait on its own send until the timeout.
    """
    received = torch.full((3,), -1.0, device=device)
    batch = [
        dist.P2POp(dist.isend, torch.full((3,), float(rank), device=device), (rank + 1) % world),
        dist.P2POp(dist.irecv, received, (rank - 1) % world),
    ]
    for request in dist.batch_isend_irecv(batch):
        request.wait()
    return received


def check_collectives(rank: int, world: int, device: torch.device) -> dict[str, str]:
    """Each collective data-parallel training uses, on small tensors of known result; name -> problem or ""."""
    problems: dict[str, str] = {}

    def full(value: float) -> torch.Tensor:
        return torch.full((3,), float(value), device=device)

    def expect(name: str, got: torch.Tensor, want: float) -> None:
        if not torch.equal(got, full(want)):
            problems[name] = f"rank {rank} got {got.tolist()}, expected {want}"

    def run(name: str, check) -> None:
        try:
            check()
        except Exception as error:  # a broken collective raises many kinds; the doctor reports them all
            problems[name] = f"rank {rank}: {type(error).__name__}: {error}".splitlines()[0]
        problems.setdefault(name, "")

    def broadcast() -> None:
        tensor = full(42 if rank == 0 else -1)
        dist.broadcast(tensor, src=0)
        expect("broadcast", tensor, 42)

    def scatter() -> None:
        received = full(-1)
        dist.scatter(received, [full(r) for r in range(world)] if rank == 0 else None, src=0)
        expect("scatter", received, rank)

    def gather() -> None:
        gathered = [full(-1) for _ in range(world)] if rank == 0 else None
        dist.gather(full(rank), gathered, dst=0)
        for source, tensor in enumerate(gathered or []):
            expect("gather", tensor, source)

    def reduce() -> None:
        tensor = full(rank + 1)
        dist.reduce(tensor, dst=0)
        if rank == 0:
            expect("reduce", tensor, world * (world + 1) / 2)

    def all_gather() -> None:
        gathered = [full(-1) for _ in range(world)]
        dist.all_gather(gathered, full(rank))
        for source, tensor in enumerate(gathered):
            expect("all_gather", tensor, source)

    def all_reduce() -> None:
        tensor = full(rank + 1)
        dist.all_reduce(tensor)
        expect("all_reduce", tensor, world * (world + 1) / 2)

    def send_recv() -> None:
        expect("send/recv", ring(rank, world, device), (rank - 1) % world)

    for name, check in [
        ("broadcast", broadcast),
        ("scatter", scatter),
        ("gather", gather),
        ("reduce", reduce),
        ("all_gather", all_gather),
        ("all_reduce", all_reduce),
        ("send/recv", send_recv),
    ]:
        if name == "send/recv" and world == 1:
            continue  # a process alone has no peer to send to (gloo cannot send to itself)
        run(name, check)
    return problems
