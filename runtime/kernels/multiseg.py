"""Fused multi-segment attention for the reuse consumer: every segment a query row reaches, in one program.

    o = multi_segment_attention(q_raw, qpos, segments, sink, window, mode, ratio, scale, inv_freq,
                                picks=None, bounds=None)

SPEC §5, relocation by query rotation: segment j (its canonical latent [n_j, D], built at 0..n_j-1, placed at
Delta_j) is attended with the query's RoPE channels turned to t - Delta_j; its partial output's RoPE channels are
turned back at that same shifted position; the parts are merged by log-sum-exp and the per-head sink joins the
denominator once. The stored latents are read in place, never rewritten or concatenated. The torch reference is
runtime/reuse/consumer.py `segment_attention` on the reference path (one call of the model's attention functions
per segment, then `merge_stacked_reference`).

Per program (query row t, block of heads) the kernel keeps the query as its even and odd channels (qe, qo), so a
RoPE pair (2i, 2i+1) is two elements at the same place of two tiles: the rotation is elementwise, and
q.k = qe.ke + qo.ko with the key tile loaded as its even and odd channels likewise. For each segment it reaches
(window rows t-Delta_j-W+1 .. t-Delta_j clipped to [0, n_j); with "causal" the entries complete before it; with
"picks" its picks in that segment) it rotates the query to t - Delta_j and streams those keys through one online
softmax shared by all segments of the row. K = V: the value tile is the key tile with its RoPE pairs turned back
at t - Delta_j, which is the per-segment de-rotation of the output applied before the sum (rotation is linear), so
no per-segment accumulator or fold is needed. Nothing per segment goes to HBM: the stacked path it replaces wrote
one float32 [rows, heads, D] part per segment and merged them in a second pass. With bf16 operands the turned
value rows are rounded to bf16 for the product (the stacked path turned the float32 part instead).

Segments come as a table (one int64 row each: latent address, n, Delta, entries address, entries count, first
global pick id); picks as one list per row of global entry ids (segment j's entry w is `first_j + w`) sorted
ascending with unused slots at the end, and `bounds` [T, P+1] the start of each segment's run in that list.
"""
from __future__ import annotations

import math

import torch

from ._triton import HAVE_TRITON, check_runnable, dot_precision, tl, triton

MODES = {"none": 0, "causal": 1, "picks": 2}
LOG2E = 1.0 / math.log(2.0)
COLS = 6          # segment table: latent ptr, n, delta, entries ptr, n_entries, first global pick id

if HAVE_TRITON:

    @triton.jit
    def _seg_block(qe, qo, ke, ko, cs, sn, valid, m_i, l_i, ae, ao, qk_scale, PREC: tl.constexpr):
        """One key tile in even/odd halves, K = V. Scores use the rotated query and the canonical keys; the values
        are the same rows with their RoPE pairs turned back at the query's shifted position (cs, sn: 1 and 0 off
        the rope pairs), which de-rotates this segment's share of the output before it joins the running sum.
        Online softmax state in the log2 domain, shared by every segment of the row."""
        s = tl.dot(qe, tl.trans(ke), input_precision=PREC)
        s = tl.dot(qo, tl.trans(ko), s, input_precision=PREC) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        kef, kof = ke.to(tl.float32), ko.to(tl.float32)
        ve = (kef * cs + kof * sn).to(ke.dtype)
        vo = (kof * cs - kef * sn).to(ke.dtype)
        pk = p.to(ke.dtype)
        ae = ae * alpha[:, None] + tl.dot(pk, ve, input_precision=PREC)
        ao = ao * alpha[:, None] + tl.dot(pk, vo, input_precision=PREC)
        return m_new, l_i, ae, ao

    @triton.jit
    def _halves(base, rows, valid, offs_i, D: tl.constexpr):
        ptr = base + rows[:, None].to(tl.int64) * D + 2 * offs_i[None, :]
        ke = tl.load(ptr, mask=valid[:, None], other=0.0)
        ko = tl.load(ptr + 1, mask=valid[:, None], other=0.0)
        return ke, ko

    @triton.jit
    def _multiseg_kernel(q_ptr, qpos_ptr, tab_ptr, picks_ptr, bounds_ptr, freq_ptr, sink_ptr, o_ptr,
                         H, P, window, ratio, n_picks, qk_scale, sink_scale, stride_qt, stride_qh,
                         MODE: tl.constexpr, D: tl.constexpr, HALF_R: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        DH: tl.constexpr = D // 2
        t = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_i = tl.arange(0, DH)                         # RoPE pair index: channels 2i, 2i+1
        offs_n = tl.arange(0, BLOCK_N)
        dt = q_ptr.dtype.element_ty
        qp = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + 2 * offs_i[None, :]
        rope = offs_i >= DH - HALF_R                      # the trailing rope channels
        freq = tl.load(freq_ptr + (offs_i - (DH - HALF_R)), mask=rope, other=0.0)
        pos = tl.load(qpos_ptr + t)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        ae = tl.zeros([BLOCK_H, DH], dtype=tl.float32)
        ao = tl.zeros([BLOCK_H, DH], dtype=tl.float32)
        for j in range(P):
            row = tab_ptr + j * 6
            lat = tl.load(row).to(tl.pointer_type(dt))
            n = tl.load(row + 1)
            c = pos - tl.load(row + 2)                     # the query's position in segment j's frame
            ent = tl.load(row + 3).to(tl.pointer_type(dt))
            n_ent = tl.load(row + 4)
            lo = tl.maximum(c - window + 1, 0)
            hi = tl.minimum(c + 1, n)
            nvis = lo * 0
            pb = lo * 0
            pe = lo * 0
            if MODE == 1:
                nvis = tl.minimum(tl.maximum(c + 1, 0) // ratio, n_ent)
            if MODE == 2:
                pb = tl.load(bounds_ptr + t * (P + 1) + j).to(tl.int64)
                pe = tl.load(bounds_ptr + t * (P + 1) + j + 1).to(tl.int64)
            if (hi > lo) | (nvis > 0) | (pe > pb):
                ang = c.to(tl.float32) * freq
                cs = tl.where(rope, tl.cos(ang), 1.0)[None, :]
                sn = tl.where(rope, tl.sin(ang), 0.0)[None, :]
                # the unturned query is read again per segment (a cache hit) rather than held in registers
                qef = tl.load(qp, mask=hmask[:, None], other=0.0).to(tl.float32)
                qof = tl.load(qp + 1, mask=hmask[:, None], other=0.0).to(tl.float32)
                qre = (qef * cs - qof * sn).to(dt)
                qro = (qof * cs + qef * sn).to(dt)
                for start in range(lo, hi, BLOCK_N):
                    rows = start + offs_n
                    valid = rows < hi
                    ke, ko = _halves(lat, rows, valid, offs_i, D)
                    m_i, l_i, ae, ao = _seg_block(qre, qro, ke, ko, cs, sn, valid, m_i, l_i, ae, ao, qk_scale,
                                                  PREC)
                if MODE == 1:
                    for start in range(0, nvis, BLOCK_N):
                        rows = start + offs_n
                        valid = rows < nvis
                        ke, ko = _halves(ent, rows, valid, offs_i, D)
                        m_i, l_i, ae, ao = _seg_block(qre, qro, ke, ko, cs, sn, valid, m_i, l_i, ae, ao, qk_scale,
                                                      PREC)
                if MODE == 2:
                    first = tl.load(row + 5)
                    for start in range(pb, pe, BLOCK_N):
                        k = start + offs_n
                        ids = tl.load(picks_ptr + t * n_picks + k, mask=k < pe, other=-1).to(tl.int64) - first
                        valid = (k < pe) & (ids >= 0) & (ids < n_ent)
                        ke, ko = _halves(ent, ids, valid, offs_i, D)
                        m_i, l_i, ae, ao = _seg_block(qre, qro, ke, ko, cs, sn, valid, m_i, l_i, ae, ao, qk_scale,
                                                      PREC)
        # the sink's exp(sink) joins the denominator once (log2 domain: 2^(sink log2e - m))
        sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32) * sink_scale
        m_safe = tl.maximum(m_i, sink)
        keep = tl.exp2(m_i - m_safe)
        scale_out = keep / (l_i * keep + tl.exp2(sink - m_safe))
        scale_out = tl.where(l_i > 0.0, scale_out, 0.0)
        op = o_ptr + t * (H * D) + offs_h[:, None] * D + 2 * offs_i[None, :]
        tl.store(op, (ae * scale_out[:, None]).to(o_ptr.dtype.element_ty), mask=hmask[:, None])
        tl.store(op + 1, (ao * scale_out[:, None]).to(o_ptr.dtype.element_ty), mask=hmask[:, None])


def segment_table(segments, device, dtype, with_entries: bool, pick_first: list[int] | None = None):
    """[P, 6] int64 on `device`: per segment its latent's address, n, Delta, entries' address (0 when none), entry
    count, first global pick id. Returns (table, keep): `keep` holds any dtype-converted copies the addresses point
    at (alive until the kernel has run). The table travels from pinned memory without a stall."""
    keep, rows = [], []
    for j, seg in enumerate(segments):
        lat = seg.latent if seg.latent.dtype == dtype else seg.latent.to(dtype)
        lat = lat.contiguous()
        keep.append(lat)
        ent = seg.entries if with_entries else None
        if ent is not None:
            ent = (ent if ent.dtype == dtype else ent.to(dtype)).contiguous()
            keep.append(ent)
        n_ent = 0 if ent is None else ent.shape[0]
        rows.append([lat.data_ptr() if lat.shape[0] else 0, lat.shape[0], int(seg.delta),
                     ent.data_ptr() if n_ent else 0, n_ent, 0 if pick_first is None else pick_first[j]])
    host = torch.tensor(rows, dtype=torch.int64).reshape(-1, COLS)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True), keep


def multi_segment_attention(q_raw: torch.Tensor, qpos: torch.Tensor, segments, sink: torch.Tensor, window: int,
                            mode: str, ratio: int, scale: float, inv_freq: torch.Tensor,
                            picks: torch.Tensor | None = None, pick_first: list[int] | None = None,
                            bounds: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                            config: dict | None = None) -> torch.Tensor:
    """q_raw [T,H,D] normed, not roped; qpos [T] request positions; segments: objects with .delta, .latent [n,D]
    and .entries [N,D] or None; sink [H]; inv_freq [rd/2] float32 (the layer's rotary). "picks": picks [T,k]
    global ids sorted ascending per row (unused: any id past every segment), pick_first[j] segment j's first
    global id, bounds [T, P+1] int32 each segment's start in the row's list (bounds[:, P] = the row's count).
    -> o [T,H,D] in out_dtype (default q's), merged with the sink, RoPE channels turned back (ready for W_a)."""
    check_runnable(q_raw)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    T, H, D = q_raw.shape
    half_r = inv_freq.numel()
    if D & (D - 1) or D < 32 or 2 * half_r > D:
        raise ValueError(f"head dim {D} must be a power of two >= 32 holding {2 * half_r} rope channels")
    if mode == "picks" and (picks is None or bounds is None or pick_first is None):
        raise ValueError("mode 'picks' needs picks, pick_first and bounds")
    dev = q_raw.device
    out = torch.empty((T, H, D), dtype=out_dtype or q_raw.dtype, device=dev)
    if T == 0:
        return out
    if q_raw.stride(-1) != 1:
        q_raw = q_raw.contiguous()
    tab, keep = segment_table(segments, dev, q_raw.dtype, mode != "none", pick_first)
    if mode == "picks":
        picks = picks.to(device=dev, dtype=torch.int32).contiguous()
        bounds = bounds.to(device=dev, dtype=torch.int32).contiguous()
        assert bounds.shape == (T, len(segments) + 1), (bounds.shape, T, len(segments))
        n_picks = picks.shape[1]
    else:
        picks = bounds = qpos
        n_picks = 0
    cfg = dict(BLOCK_H=min(64, max(16, triton.next_power_of_2(H))), BLOCK_N=32 if D >= 512 else 16,
               num_warps=8 if D >= 512 and H > 16 else 4, num_stages=1)
    cfg.update(config or {})
    grid = (T, triton.cdiv(H, cfg["BLOCK_H"]))
    _multiseg_kernel[grid](q_raw, qpos.to(device=dev, dtype=torch.int64).contiguous(), tab, picks, bounds,
                           inv_freq.to(device=dev, dtype=torch.float32).contiguous(),
                           sink.to(device=dev, dtype=torch.float32).contiguous(), out,
                           H, len(segments), int(window), max(int(ratio), 1), n_picks, float(scale) * LOG2E, LOG2E,
                           q_raw.stride(0), q_raw.stride(1), MODE=MODES[mode], D=D, HALF_R=half_r,
                           BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], PREC=dot_precision(q_raw.dtype),
                           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    del keep
    return out
