"""One call of each of MKL's vector math functions before any op runs on several threads.

torch's x86 wheels bundle oneMKL 2024.2, which picks the kernel of each vector math (VML) function on that function's
first call. When that first call runs on several of torch's intra-op threads at once (a fresh process's first
``sqrt`` of more than 2,048 elements, on a busy machine), one thread can compute its whole share with MKL's
low-accuracy kernel, about 1e-4 off, once (pytorch/pytorch#188792; oneMKL 2025.0 and later are fixed). In DDP on CPU,
an AdamW step's ``sqrt`` on one rank then leaves that rank's weights apart from the others' for the rest of the run.
"""

import torch

# ATen's unary ops that call MKL's VML, in float32 and float64 (aten/src/ATen/cpu/vml.h of torch 2.13).
VML_OPS = (
    "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt", "tan",
    "tanh", "trunc",
)  # fmt: skip


def settle_vector_math() -> None:
    """Call each of ``VML_OPS`` once on one element (on one thread), so MKL picks its kernels before any concurrent
    call. Nothing to do where torch has no MKL."""
    if not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        value = torch.full((1,), 0.5, dtype=dtype)
        for op in VML_OPS:
            getattr(torch, op)(value)
