"""RoPE on the trailing rope channels only, in place: the consumer turns the 64 RoPE channels of a query or a
partial output per segment and never rebuilds the 512-wide tensor (`Rotary.apply` does, with a concatenation).

    rope_(x, cos, sin, inverse=False, src=None)

x [T, H, D] (rows may be strided, the last dim contiguous); cos/sin [T, rd/2] float32; the trailing rd channels of
x (or of `src`, same shape, when given: x's other channels are left as they are) are rotated by the interleaved
pairs (2i, 2i+1) in float32 and written back in x's dtype: the numerics of runtime/model/deepseek_v4.py
`Rotary.apply`. On CUDA one Triton program per (row, block of heads); elsewhere the torch reference.
"""
from __future__ import annotations

import torch

from . import _triton                          # `_triton.enabled`: the one switch, read at call time
from ._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:

    @triton.jit
    def _rope_kernel(x_ptr, s_ptr, cos_ptr, sin_ptr, rows_ptr, H, stride_xt, stride_xh, stride_st, stride_sh,
                     rope_off, INVERSE: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     ROW_IDS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)                # the angles' row
        if ROW_IDS:
            r = tl.load(rows_ptr + t)                    # x's row
        else:
            r = t
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_i = tl.arange(0, HALF)
        c = tl.load(cos_ptr + t * HALF + offs_i)[None, :]
        s = tl.load(sin_ptr + t * HALF + offs_i)[None, :]
        if INVERSE:
            s = -s
        src = s_ptr + r * stride_st + offs_h[:, None] * stride_sh + rope_off + 2 * offs_i[None, :]
        xe = tl.load(src, mask=hmask[:, None], other=0.0).to(tl.float32)
        xo = tl.load(src + 1, mask=hmask[:, None], other=0.0).to(tl.float32)
        dst = x_ptr + r * stride_xt + offs_h[:, None] * stride_xh + rope_off + 2 * offs_i[None, :]
        tl.store(dst, (xe * c - xo * s).to(x_ptr.dtype.element_ty), mask=hmask[:, None])
        tl.store(dst + 1, (xo * c + xe * s).to(x_ptr.dtype.element_ty), mask=hmask[:, None])


def rope_reference_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
                    src: torch.Tensor | None = None) -> torch.Tensor:
    """Torch path: the arithmetic of `Rotary.apply`, written into x's rope slice."""
    rd = cos.shape[-1] * 2
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    rope = (x if src is None else src)[..., -rd:].float()
    xe, xo = rope[..., 0::2], rope[..., 1::2]
    x[..., -rd:] = torch.stack((xe * c - xo * s, xo * c + xe * s), dim=-1).flatten(-2)
    return x


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
          src: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x's trailing rope channels in place (from `src`'s when given); returns x. `rows` (int64 [R] on x's
    device): only these rows of x, row rows[i] at the angles cos[i]/sin[i] (one launch over rows gathered from
    anywhere in x, e.g. the served rows of every part of a stacked buffer)."""
    assert x.dim() == 3 and cos.shape == sin.shape, (x.shape, cos.shape)
    assert cos.shape[0] == (x.shape[0] if rows is None else rows.shape[0]), (x.shape, cos.shape)
    assert src is None or src.shape == x.shape, (src.shape, x.shape)
    if rows is not None and src is not None:
        raise ValueError("rope_: rows with a separate src is not supported")
    if not _triton.enabled(x):
        if rows is None:
            return rope_reference_(x, cos, sin, inverse, src)
        x[rows] = rope_reference_(x[rows], cos, sin, inverse)
        return x
    T = cos.shape[0]
    _, H, D = x.shape
    half = cos.shape[-1]
    assert (half & (half - 1)) == 0, f"rope pairs {half} must be a power of two"
    src = x if src is None else src
    assert x.stride(-1) == 1 and src.stride(-1) == 1, "the channel dim must be contiguous"
    if T == 0 or H == 0:
        return x
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    block_h = min(16, triton.next_power_of_2(H))
    _rope_kernel[(T, triton.cdiv(H, block_h))](x, src, cos, sin, cos if rows is None else rows, H, x.stride(0),
                                               x.stride(1), src.stride(0), src.stride(1), D - 2 * half,
                                               INVERSE=inverse, HALF=half, BLOCK_H=block_h,
                                               ROW_IDS=rows is not None, num_warps=1)
    return x
