"""The experts' SwiGLU between their projections in one pass: h = (silu(clamp(gate)) * clamp(up) * w).to(dtype),
in float32 inside, from the two projections' outputs as they come (bf16) to the input of W_2 (bf16).

The torch form (`swiglu_activation` in runtime/kernels/reference.py, with the model's casts) makes eight passes over the
[rows, inter] block: two float32 copies, the two clamps, silu, the product, the routing weight, the cast back. It
runs for every expert of every MoE layer in both arms (at 128K tokens in the recompute arm, ~1 s of elementwise
kernels in the profile of docs/BENCHMARKS.md run 16), and in the reuse arm's active rows' per-expert loop each of
those passes is a launch the GPU may wait for.

    from runtime.kernels.swiglu import swiglu, supported
    h = swiglu(gate, up, weights, limit)        # gate, up [n, inter]; weights [n, 1] float32 or None; limit 0: none

One program per (row, block of columns). Numerics: the torch form's, op for op in float32 (min for the gate's
clamp, max then min for the up's, silu as g / (1 + exp(-g)), then * up, then * the row's weight), rounded once.
`tests/kernels/test_swiglu.py` compares them (compiled on the GPU, or under the interpreter).
"""
from __future__ import annotations

import torch

from .reference import swiglu_activation  # the torch form

from ._triton import HAVE_TRITON, check_runnable, tl, triton

BLOCK = 1024

if HAVE_TRITON:

    @triton.jit
    def _swiglu_kernel(g_ptr, u_ptr, w_ptr, h_ptr, n_cols, stride_g, stride_u, stride_h, limit,
                       HAS_LIMIT: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u
        if HAS_W:
            h = h * tl.load(w_ptr + row)
        tl.store(h_ptr + row * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None, limit: float,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch form: the model's `swiglu_activation` on the float32 copies, cast to `dtype` (gate's by default)."""
    return swiglu_activation(gate.float(), up.float(), weights, limit).to(gate.dtype if dtype is None else dtype)


def supported(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None) -> bool:
    """gate and up [n, inter] of one shape and a 16-bit or float32 dtype, each row's columns contiguous; weights
    None or float32 with one value per row ([n] or [n, 1])."""
    return (gate.dim() == 2 and up.shape == gate.shape and gate.numel() > 0
            and gate.dtype in (torch.bfloat16, torch.float16, torch.float32) and up.dtype == gate.dtype
            and gate.stride(-1) == 1 and up.stride(-1) == 1
            and (weights is None or (weights.dtype == torch.float32 and weights.numel() == gate.shape[0]
                                     and weights.shape[0] == gate.shape[0] and weights.device == gate.device)))


def swiglu(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None, limit: float,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    if not supported(gate, up, weights):
        w = "None" if weights is None else f"{weights.dtype} {tuple(weights.shape)}"
        raise ValueError(f"swiglu takes gate and up [n, inter] of one shape and dtype with contiguous rows, and "
                         f"float32 weights with one value per row or None; got gate {gate.dtype} "
                         f"{tuple(gate.shape)} strides {gate.stride()}, up {up.dtype} {tuple(up.shape)} strides "
                         f"{up.stride()}, weights {w}")
    check_runnable(gate)
    n, cols = gate.shape
    h = torch.empty((n, cols), dtype=gate.dtype if dtype is None else dtype, device=gate.device)
    w = None if weights is None else weights.reshape(n).contiguous()
    _swiglu_kernel[(n, triton.cdiv(cols, BLOCK))](gate, up, gate if w is None else w, h, cols, gate.stride(0),
                                                   up.stride(0), h.stride(0), float(limit), HAS_LIMIT=limit > 0,
                                                   HAS_W=w is not None, BLOCK=BLOCK, num_warps=4)
    return h
