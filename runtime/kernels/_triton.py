"""The one guarded Triton import. Kernel modules define their @triton.jit functions only when HAVE_TRITON."""
from __future__ import annotations

import os

import torch

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # ImportError, or a Triton that cannot initialise its backend
    triton, tl = None, None
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """True when the Triton kernels can run here: Triton imports and a CUDA device is present."""
    return HAVE_TRITON and torch.cuda.is_available()


def check_runnable(t: torch.Tensor) -> None:
    """Kernels run on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1, for debugging)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not importable here; use the reference path (runtime.kernels.reference)")
    if not (t.is_cuda or INTERPRET):
        raise RuntimeError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for a CPU debug run)")


def dot_precision(dtype: torch.dtype) -> str:
    """Input precision of the kernels' tl.dot: float32 operands are multiplied in full float32 ("ieee"), so that
    the float32 path equals the float32 reference to rounding (Triton's default for float32 is TF32, a 10-bit
    mantissa); for bf16/fp16 operands "tf32" is Triton's own default and changes nothing."""
    return "ieee" if dtype == torch.float32 else "tf32"
