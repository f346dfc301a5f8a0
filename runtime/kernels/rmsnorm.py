"""The RMS norm in one pass, each row read once and written once, in float32 inside:
- weighted, y = (w * (x * rsqrt(mean(x^2) + eps))).to(x.dtype): the numerics of runtime/model/deepseek_v4.py
  `RMSNorm`, whose torch form makes six passes over the row (the float32 copy, the square, the mean, two products
  and the cast, ~40 bytes moved per element of a bf16 row against this kernel's 4). It runs on every row of every
  layer in both arms: `attn_norm`, `ffn_norm` (4096 wide) and `q_norm` (1024);
- unweighted (weight None), y = x * rsqrt(mean(x^2) + eps).to(x.dtype): the numerics of `unweighted_rms_norm`, the
  per-head query norm (512 wide, every query row x head of every layer: in the reuse arm the active rows' 64 heads
  and every other row's Global heads). Its torch form's product is taken in x's dtype with the factor rounded to
  it first; the kernel rounds the factor the same way and the product once.

    from runtime.kernels.rmsnorm import rms_norm, supported
    y = rms_norm(x, weight, eps)            # x [..., dim], rows may be strided, the last dim contiguous
    y = rms_norm(x, None, eps)              # unweighted

One program per row, the row in one block of the next power of two >= dim. `bench/rmsnorm.py` times it against the
torch form and the copy rate; `tests/kernels/test_rmsnorm.py` compares them (compiled on the GPU, or under the
interpreter), and the whole-model interpreter and GPU tests run it in every layer.
"""
from __future__ import annotations

import torch

from .reference import unweighted_rms_norm_reference, weighted_rms_norm  # the torch forms

from ._triton import HAVE_TRITON, check_runnable, tl, triton

MAX_DIM = 16384

if HAVE_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, dim, stride_x, stride_y, eps, BLOCK: tl.constexpr,
                         HAS_W: tl.constexpr = True):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            y = w * (x * r)
        else:                           # the factor rounded to x's dtype first, as the torch form's cast does
            y = x * r.to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The torch form `rms_norm` computes: weighted_rms_norm, or unweighted_rms_norm_reference for weight None."""
    return unweighted_rms_norm_reference(x, eps) if weight is None else weighted_rms_norm(x, weight, eps)


def supported(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Rows [..., dim] whose last dim is contiguous, dim <= MAX_DIM, and a float32 weight of dim entries or None."""
    return (x.dim() >= 1 and x.numel() > 0 and x.stride(-1) == 1 and 0 < x.shape[-1] <= MAX_DIM
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (weight is None or (weight.dtype == torch.float32 and weight.shape == (x.shape[-1],)
                                    and weight.is_contiguous())))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if not supported(x, weight):
        got = "None" if weight is None else f"{weight.dtype} {tuple(weight.shape)}"
        raise ValueError(f"rms_norm takes rows [..., dim] with a contiguous last dim (dim <= {MAX_DIM}) and a float32 "
                         f"weight [dim] or None; got x {x.dtype} {tuple(x.shape)} strides {x.stride()}, weight {got}")
    check_runnable(x)
    dim = x.shape[-1]
    rows = x.reshape(-1, dim) if x.dim() != 2 else x          # a view where the leading dims allow it
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        BLOCK = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](rows, rows if weight is None else weight, y, dim, rows.stride(0),
                                           y.stride(0), eps, BLOCK=BLOCK, HAS_W=weight is not None,
                                           num_warps=min(16, max(1, BLOCK // 512)))
    return y.view(x.shape)
