"""Fused N-way log-sum-exp merge of partial attention outputs, with the per-head sink joining the
denominator once after the merge: equal to runtime/model/deepseek_v4.py `merge_with_sink`.

    total[t,h] = logsumexp(lse_1[t,h], .., lse_P[t,h], sink[h])
    out[t,h,:] = sum_i exp(lse_i[t,h] - total[t,h]) * o_i[t,h,:]

One pass: each part's output is read once and the result written once (the reference makes P read-modify-write
passes over an fp32 accumulator). Parts are passed as tables of device addresses, so P is not a compile-time
constant and the parts need not be stacked (a stack would copy them).
"""
from __future__ import annotations

import torch

from . import _triton                          # `_triton.enabled`: the one switch, read at call time
from ._triton import HAVE_TRITON, check_runnable, tl, triton

if HAVE_TRITON:

    @triton.jit
    def _tile(R, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """This program's flattened (t, h) rows and output columns, with their masks."""
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        return rows, rows < R, offs_d, offs_d < D

    @triton.jit
    def _merge_kernel(o_tab, lse_tab, sink_ptr, out_ptr, lse_out_ptr, R, H, P,
                      HAS_SINK: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows, rmask, offs_d, dmask = _tile(R, D, BLOCK_R, BLOCK_D)
        if HAS_SINK:
            m = tl.load(sink_ptr + rows % H, mask=rmask, other=0.0).to(tl.float32)
        else:
            m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for i in range(P):
            lp = tl.load(lse_tab + i).to(tl.pointer_type(tl.float32))
            m = tl.maximum(m, tl.load(lp + rows, mask=rmask, other=float("-inf")))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        if HAS_SINK:
            den = tl.exp(tl.load(sink_ptr + rows % H, mask=rmask, other=0.0).to(tl.float32) - m_safe)
        else:
            den = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for i in range(P):
            lp = tl.load(lse_tab + i).to(tl.pointer_type(tl.float32))
            op = tl.multiple_of(tl.load(o_tab + i).to(tl.pointer_type(tl.float32)), 16)   # torch allocations
            w = tl.exp(tl.load(lp + rows, mask=rmask, other=float("-inf")) - m_safe)   # 0 for empty parts
            den += w
            o = tl.load(op + rows[:, None] * D + offs_d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
            acc += w[:, None] * o
        den_safe = tl.where(den == 0.0, 1.0, den)
        tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], acc / den_safe[:, None],
                 mask=rmask[:, None] & dmask[None, :])
        if tl.program_id(1) == 0:
            lse = tl.where(den == 0.0, float("-inf"), m_safe + tl.log(den_safe))
            tl.store(lse_out_ptr + rows, lse, mask=rmask)


def merge_lse(parts: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor | None = None,
              return_lse: bool = False):
    """parts: [(o [T,H,D], lse [T,H])], sink [H] or None -> merged o [T,H,D] float32 (and the merged LSE
    [T,H], the sink included, when return_lse)."""
    if not parts:
        raise ValueError("merge_lse needs at least one part")
    o0, l0 = parts[0]
    check_runnable(o0)
    T, H, D = o0.shape
    os_, ls_ = [], []
    for o, lse in parts:
        if o.shape != (T, H, D) or lse.shape != (T, H):
            raise ValueError("all parts must share o [T,H,D] and lse [T,H]")
        os_.append(o.float().contiguous())
        ls_.append(lse.float().contiguous())
    out = torch.empty((T, H, D), dtype=torch.float32, device=o0.device)
    lse_out = torch.empty((T, H), dtype=torch.float32, device=o0.device)
    R = T * H
    if R == 0:
        return (out, lse_out) if return_lse else out
    o_tab = torch.tensor([o.data_ptr() for o in os_], dtype=torch.int64, device=o0.device)
    l_tab = torch.tensor([lse.data_ptr() for lse in ls_], dtype=torch.int64, device=o0.device)
    has_sink = sink is not None
    s = sink.float().contiguous() if has_sink else ls_[0]
    BLOCK_D = min(triton.next_power_of_2(D), 512)
    BLOCK_R = max(1, 4096 // BLOCK_D)
    grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(D, BLOCK_D))
    _merge_kernel[grid](o_tab, l_tab, s, out, lse_out, R, H, len(parts),
                        HAS_SINK=has_sink, D=D, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, num_warps=4)
    return (out, lse_out) if return_lse else out


# ---------------------------------------------------------------------------------------------------------------
# Stacked parts: one buffer o [P,T,H,D], lse [P,T,H]; a part that did not cover a row has lse -inf there and its
# o rows are never read (they may be unwritten). The consumer writes every segment's partial output into its
# slice of one buffer, so the merge needs no table of pointers (whose host->device copy would stall the stream).

if HAVE_TRITON:

    @triton.jit
    def _merge_stacked_kernel(o_ptr, lse_ptr, sink_ptr, out_ptr, R, H, P, stride_op, stride_lp,
                              D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows, rmask, offs_d, dmask = _tile(R, D, BLOCK_R, BLOCK_D)
        sink = tl.load(sink_ptr + rows % H, mask=rmask, other=0.0).to(tl.float32)
        m = sink
        lp = lse_ptr                                                     # running pointers: no i * stride product
        for i in range(P):
            m = tl.maximum(m, tl.load(lp + rows, mask=rmask, other=float("-inf")))
            lp += stride_lp
        den = tl.exp(sink - m)                                           # the sink joins the denominator once
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        lp = lse_ptr
        op = o_ptr
        for i in range(P):
            w = tl.exp(tl.load(lp + rows, mask=rmask, other=float("-inf")) - m)
            den += w
            live = rmask & (w > 0.0)                                     # rows this part did not cover: unread
            o = tl.load(op + rows[:, None] * D + offs_d[None, :], mask=live[:, None] & dmask[None, :],
                        other=0.0).to(tl.float32)
            acc += w[:, None] * o
            lp += stride_lp
            op += stride_op
        tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], (acc / den[:, None]).to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & dmask[None, :])


def merge_stacked_reference(o: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, out_dtype: torch.dtype,
                            ranges: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """Torch path of `merge_stacked`; `ranges[p]` = (lo, hi), the rows part p covered (all rows when None)."""
    P, T, H, D = o.shape
    total = torch.logsumexp(torch.cat([lse.float(), sink.float().expand(1, T, H)]), dim=0)   # finite: the sink
    out = torch.zeros((T, H, D), dtype=torch.float32, device=o.device)
    for p in range(P):
        lo, hi = (0, T) if ranges is None else ranges[p]
        w = torch.exp(lse[p, lo:hi] - total[lo:hi]).unsqueeze(-1)
        out[lo:hi] += torch.where(w > 0, o[p, lo:hi].float(), 0.0) * w
    return out.to(out_dtype)


def merge_stacked(o: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, out_dtype: torch.dtype,
                  ranges: list[tuple[int, int]] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """o [P,T,H,D] (float32 or bf16), lse [P,T,H] float32 natural log (-inf where part p has no key for the row:
    its o rows are then never read), sink [H] -> merged o [T,H,D] in out_dtype, the sink's exp(sink) added to the
    denominator once; written into `out` (contiguous [T,H,D] of out_dtype, e.g. a caller's row slice) when given.
    One pass on CUDA (Triton); elsewhere the torch reference (which uses `ranges`)."""
    P, T, H, D = o.shape
    assert lse.shape == (P, T, H) and sink.shape == (H,), (o.shape, lse.shape, sink.shape)
    if out is not None and (out.shape != (T, H, D) or out.dtype != out_dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {(T, H, D)} {out_dtype} tensor, got {tuple(out.shape)} "
                         f"{out.dtype}")
    if P == 0 or not _triton.enabled(o):
        ref = merge_stacked_reference(o, lse, sink, out_dtype, ranges)       # no parts: only the sink, zeros
        return ref if out is None else out.copy_(ref)
    assert o.stride(-1) == 1 and o[0].is_contiguous() and lse[0].is_contiguous(), "parts must be dense"
    if out is None:
        out = torch.empty((T, H, D), dtype=out_dtype, device=o.device)
    R = T * H
    if R == 0:
        return out
    BLOCK_D = min(triton.next_power_of_2(D), 512)
    BLOCK_R = max(1, 4096 // BLOCK_D)
    grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(D, BLOCK_D))
    _merge_stacked_kernel[grid](o, lse.float(), sink.float().contiguous(), out, R, H, P, o.stride(0),
                                lse.stride(0), D=D, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, num_warps=4)
    return out
