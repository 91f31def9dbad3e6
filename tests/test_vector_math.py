"""training/job/vector_math.py: every function of MKL's vector math that torch calls is called once, on one element
and one thread, before a run starts. What it prevents (a first concurrent call that computes one thread's share with
MKL's low-accuracy kernel) shows only now and then on a busy machine, in a fresh process; the two-host test of
tests/test_launcher.py, with two threads per process, checks the weights it would set apart."""

import re
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import training.config.cli
from training.job.vector_math import VML_OPS, settle_vector_math


class Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, torch.dtype, int]] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor):
            self.seen.add((func.__name__, args[0].dtype, args[0].numel()))
        return func(*args, **(kwargs or {}))


def test_every_op_that_calls_mkls_vector_math_in_this_torch_is_settled():
    header = Path(torch.__file__).parent / "include" / "ATen" / "cpu" / "vml.h"
    if not header.exists():
        pytest.skip(f"this torch ({torch.__version__}) has no C++ headers to read its MKL ops from")
    called = re.findall(r"^IMPLEMENT_VML_MKL\((\w+),", header.read_text(), re.MULTILINE)
    assert called, f"{header} names no MKL op: torch {torch.__version__} calls them another way"
    assert sorted(called) == sorted(VML_OPS), f"torch {torch.__version__} calls MKL for {called}"


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch has no MKL")
def test_each_op_runs_once_on_one_element_in_float32_and_float64():
    with Calls() as calls:
        settle_vector_math()
    assert calls.seen == {(op, dtype, 1) for op in VML_OPS for dtype in (torch.float32, torch.float64)}


def test_the_cli_settles_them_before_it_parses(monkeypatch):
    order = []
    monkeypatch.setattr(training.config.cli, "settle_vector_math", lambda: order.append("settled"))
    monkeypatch.setattr(training.config.cli, "use_omegaconf_loader", lambda: order.append("parsing"))
    with pytest.raises(SystemExit):
        training.config.cli.main(["--help"])
    assert order[:2] == ["settled", "parsing"]
