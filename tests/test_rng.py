"""Random states in checkpoints: each rank keeps and gets back the CUDA state of its own GPU, whatever the GPUs of
the machine it resumes on."""

import io
import random
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.helpers import needs_gpus
from training import RNGStateCheckpoint

NOT_RESTORED = "CUDA random state is not restored, so the resumed run will not repeat the interrupted one bit for bit"


class FakeGPUs:
    """``count`` GPUs' CUDA generators in place of torch.cuda's, recording which device each call reads or sets."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
        self.states = {index: torch.full((16,), index, dtype=torch.uint8) for index in range(count)}
        self.read: list[int] = []
        self.set: list[int] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        # torch.cuda's *_all functions call these through torch.cuda.random.
        for module in (torch.cuda, torch.cuda.random):
            monkeypatch.setattr(module, "device_count", lambda: count)
            monkeypatch.setattr(module, "get_rng_state", self.get_rng_state)
            monkeypatch.setattr(module, "set_rng_state", self.set_rng_state)

    def index(self, device: int | str | torch.device) -> int:
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if index >= len(self.states):  # as torch.cuda.default_generators[index] does
            raise IndexError("tuple index out of range")
        return index

    def get_rng_state(self, device: int | str | torch.device = "cuda") -> torch.Tensor:
        self.read.append(self.index(device))
        return self.states[self.read[-1]].clone()

    def set_rng_state(self, state: torch.Tensor, device: int | str | torch.device = "cuda") -> None:
        self.set.append(self.index(device))
        self.states[self.set[-1]] = state.clone()


def rank_on(device: str) -> SimpleNamespace:
    """The Trainer of a one-process run on ``device``, as the callback sees it."""
    return SimpleNamespace(world_size=1, global_rank=0, strategy=SimpleNamespace(root_device=torch.device(device)))


def saved_checkpoint(device: str) -> dict:
    """A checkpoint saved on ``device``, through torch.save and torch.load(weights_only=True) as the CLI loads it."""
    checkpoint: dict = {}
    RNGStateCheckpoint().on_save_checkpoint(rank_on(device), None, checkpoint)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def draws() -> tuple:
    """The next draws of Python's, NumPy's and torch's CPU generators."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_a_checkpoint_keeps_the_cuda_state_of_the_ranks_own_gpu_only(monkeypatch):
    gpus = FakeGPUs(monkeypatch, count=4)
    checkpoint = saved_checkpoint("cuda:2")
    assert gpus.read == [2]
    assert torch.equal(checkpoint["rng_states"][0]["cuda"], gpus.states[2])


def test_a_resume_with_fewer_gpus_gives_the_rank_its_state_on_its_own_gpu(monkeypatch):
    FakeGPUs(monkeypatch, count=4)
    checkpoint = saved_checkpoint("cuda:2")
    saved_gpu_state = checkpoint["rng_states"][0]["cuda"]
    expected = draws()
    gpus = FakeGPUs(monkeypatch, count=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RNGStateCheckpoint().on_load_checkpoint(rank_on("cuda:0"), None, checkpoint)
    assert gpus.set == [0] and torch.equal(gpus.states[0], saved_gpu_state)
    assert draws() == expected


@pytest.mark.parametrize(("saved_on", "resumed_on", "held"), [("cuda:0", "cpu", "a"), ("cpu", "cuda:0", "no")])
def test_a_resume_between_gpu_and_cpu_restores_the_other_states_and_warns(monkeypatch, saved_on, resumed_on, held):
    gpus = FakeGPUs(monkeypatch, count=1)
    checkpoint = saved_checkpoint(saved_on)
    expected = draws()
    message = (
        f"holds {held} CUDA random state for rank 0 but this run puts that rank on {resumed_on}: its {NOT_RESTORED}"
    )
    with pytest.warns(UserWarning, match=message):
        RNGStateCheckpoint().on_load_checkpoint(rank_on(resumed_on), None, checkpoint)
    assert gpus.set == []
    assert draws() == expected


def test_a_checkpoint_with_every_visible_gpus_state_gives_the_rank_that_of_its_device_index(monkeypatch):
    # The layout RNGStateCheckpoint wrote before it kept each rank's own device only.
    gpus = FakeGPUs(monkeypatch, count=2)
    checkpoint = saved_checkpoint("cpu")
    checkpoint["rng_states"][0]["cuda"] = [torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(2)]
    RNGStateCheckpoint().on_load_checkpoint(rank_on("cuda:1"), None, checkpoint)
    assert gpus.set == [1] and torch.equal(gpus.states[1], torch.full((16,), 11, dtype=torch.uint8))


@needs_gpus(1)
def test_a_resume_on_a_gpu_draws_what_the_interrupted_run_would_have():
    device = f"cuda:{torch.cuda.device_count() - 1}"  # the rank's own GPU, the first only on a one-GPU machine
    torch.cuda.manual_seed_all(0)
    torch.rand(3, device=device)  # the state saved is not the seed's
    checkpoint = saved_checkpoint(device)
    expected = torch.rand(3, device=device).tolist(), *draws()
    torch.cuda.manual_seed_all(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RNGStateCheckpoint().on_load_checkpoint(rank_on(device), None, checkpoint)
    assert (torch.rand(3, device=device).tolist(), *draws()) == expected
