"""Fused multi-segment attention for the reuse consumer: every segment a query row reaches, in one program.

    o = multi_segment_attention(q_raw, qpos, segments, sink, window, mode, ratio, scale, inv_freq,
                                picks=None, bounds=None)

SPEC §5, relocation by query rotation: segment j (its canonical latent [n_j, D], built at 0..n_j-1, placed at
Delta_j) is attended with the query's RoPE channels turned to t - Delta_j; its partial output's RoPE channels are
turned back at that same shifted position; the parts are merged by log-sum-exp and the per-head sink joins the
denominator once. The stored latents are read in place, never rewritten or concatenated. The torch reference is
runtime/reuse/segments.py `segment_attention` on the reference path (one call of the model's attention functions
per segment, then `merge_stacked_reference`).

Per program (query row t, block of heads), for each segment it reaches (window rows t-Delta_j-W+1 .. t-Delta_j
clipped to [0, n_j); with "causal" the entries complete before it; with "picks" its picks in that segment), the
key tiles stream through one online softmax shared by every segment of the row. Only the trailing rope channels
depend on the segment, so the work splits:
- non-rope channels: the query is loaded once with its rope channels zeroed; each key tile is read contiguously
  ([BLOCK_N, D], vectorized) and serves the score's non-rope part and the value sum (K = V) of all D channels, of
  which the rope channels are not used;
- rope channels: the query's rope pairs (2r, 2r+1), as even and odd halves, are turned to t - Delta_j per
  segment; the tile's rope pairs are read again as halves (a cache hit) for the rope part of the score and for a
  per-segment rope value sum, which at the segment's end is turned back at t - Delta_j (the conjugate rotation:
  the per-segment de-rotation of the output, which acts on the rope channels only) and added to the row's.
Nothing per segment goes to HBM: the stacked path (runtime/reuse/segments.py) writes one float32 [rows, heads, D]
part per segment and merges them in a second pass.

Where it is used (RuntimePolicy.fused_min_heads): calls of at least 16 heads, i.e. the active rows' 64, where it is
faster than the stacked path; the 8 Global heads' calls keep the stacked path (half of each 16-row tile idle, and
this kernel's extra rope dots and loads per tile) below RuntimePolicy.fused_min_segments, except HCA calls over
key_frame_min_segments_hca (16) segments or more, fused in the key frame.

Calls of fewer than 16 heads (the 8 Global heads) go to `_multiseg_packed_kernel`: ROWS consecutive query rows
per program (ROWS x heads = 16 by default), so that the MMA tile's rows are filled and neighbouring rows share their
window and entry tiles. It serves models whose calls have fewer heads than the tile (the tests' tiny configs under
a lowered fused_min_heads); on Flash's 8 Global heads at 32K (one H100, bench/multiseg.py, since the key tiles are
read 16 bytes at a time) it is faster than the stacked path in HCA layers (1.07x at 8 documents, 1.63x at 32) and
slower in window and CSA own-picks layers at 8 documents; since each program walks only its rows' segments
(`_span`) its CSA own-picks call beats the stacked one at 32 documents too (6.2 ms against 7.2, one H100).

`_multiseg_keyframe_kernel` (runtime/kernels/keyframe.py; the building blocks both frames share are in
runtime/kernels/multiseg_tiles.py) (`key_frame=True`: the "picks" calls of RuntimePolicy.key_frame_min_heads heads or
more, one row per program; HCA calls over RuntimePolicy.key_frame_min_segments_hca segments or more, with few heads
KEY_ROWS // heads rows per program sharing each entry tile): the same scores with the turn on the keys,
q(t - Delta_j) . k = q(t) . k(+Delta_j). The query is turned once to t; each key tile's rope pairs are turned in
registers by +Delta of the segment each key lies in (the stored rows are read in place, never
rewritten); the rope value sums are then in the request frame and turned back once at t. A row's keys become one
loop whatever the segments (window positions, then visible entries by global id or picks), each key tile free to
span segments, where `_multiseg_kernel` runs one short loop per segment (about one tile of a row's 512 picks split over
9 segments, so nothing pipelines): faster for CSA's picks, and for HCA where many short documents leave each
segment's entries a fraction of a tile; slower for HCA's long causal runs of few segments. It equals the reference
under the interpreter and compiles for sm_90.

No kernel passes over every segment per row or per key tile: the query-frame kernels walk only the segments from
the one holding their rows' earliest window key to the latest row's (causal: from the first), widened to each row's
first and last segment with picks (`_span`; segments in increasing Delta and disjoint, else all of them), and the
key-frame kernel finds each key tile's segments between its least and greatest key (`_locate`), each from one
count over the table's starts. A row of a 64-document request reaches two or three of its 66 segments (one H100,
bench/multiseg.py at 64K and 64 documents: all fused calls 40.6 ms against 47.2 with the key frame's whole-table
walk; the 8 Global heads' CSA call 12.6 ms, under the stacked path's 13.1).

Segments come as a table (one int64 row each: latent address, n, Delta, entries address, entries count, first
global pick id); picks as one list per row of global entry ids (segment j's entry w is `first_j + w`) sorted
ascending with unused slots at the end, and `bounds` [T, P+1] the start of each segment's run in that list.
"""
from __future__ import annotations

import math

import torch

from ._host import aligned, to_device_nowait
from ._triton import HAVE_TRITON, check_runnable, dot_precision, tl, triton

if HAVE_TRITON:
    from .keyframe import _multiseg_keyframe_kernel
    from .multiseg_tiles import _finish, _query_rows, _seg_tile, _segment, _span, _start, _turn_query

MODES = {"none": 0, "causal": 1, "picks": 2}
LOG2E = 1.0 / math.log(2.0)
KEY_ROWS = 64     # the key-frame kernel's (query row, head) pairs per program in an HCA call of few heads
COLS = 6          # segment table: latent ptr, n, delta, entries ptr, n_entries, first global pick id

if HAVE_TRITON:

    @triton.jit
    def _multiseg_kernel(q_ptr, qpos_ptr, tab_ptr, picks_ptr, bounds_ptr, freq_ptr, sink_ptr, o_ptr,
                         H, P, window, ratio, n_picks, qk_scale, sink_scale, stride_qt, stride_qh,
                         MODE: tl.constexpr, D: tl.constexpr, HALF_R: tl.constexpr, RP: tl.constexpr,
                         COLS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                         SPAN: tl.constexpr, PB: tl.constexpr):
        NOPE: tl.constexpr = D - 2 * HALF_R
        t = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_d = tl.arange(0, D)
        offs_r = tl.arange(0, RP)                         # rope pair r: channels NOPE + 2r, NOPE + 2r + 1
        rmask = offs_r < HALF_R                           # RP: HALF_R padded to the 16 a dot needs
        offs_n = tl.arange(0, BLOCK_N)
        dt = q_ptr.dtype.element_ty
        qrow = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
        qn = tl.load(qrow + offs_d[None, :], mask=hmask[:, None] & (offs_d[None, :] < NOPE), other=0.0)
        freq = tl.load(freq_ptr + offs_r, mask=rmask, other=0.0)
        pos = tl.load(qpos_ptr + t)
        m_i, l_i, acc, ar_e, ar_o = _start(BLOCK_H, D, RP)
        j0 = 0
        j1 = P
        if SPAN:
            j0, j1 = _span(tab_ptr, bounds_ptr, P, t + 1, t, pos - window + 1, pos, MODE, 1, COLS, PB)
        for j in range(j0, j1):
            lat, n, delta, ent, n_ent = _segment(tab_ptr, j, COLS, dt)
            c = pos - delta                                # the query's position in segment j's frame
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
                qre, qro, cs, sn = _turn_query(qrow, c.to(tl.float32), freq[None, :], hmask[:, None] & rmask[None, :],
                                               offs_r, NOPE, dt)
                sr_e = tl.zeros([BLOCK_H, RP], dtype=tl.float32)
                sr_o = tl.zeros([BLOCK_H, RP], dtype=tl.float32)
                for start in range(lo, hi, BLOCK_N):
                    rows = start + offs_n
                    m_i, l_i, acc, sr_e, sr_o, ar_e, ar_o = _seg_tile(
                        qn, qre, qro, lat, rows, rows < hi, (rows < hi)[None, :], offs_d, offs_r, rmask, m_i, l_i,
                        acc, sr_e, sr_o, ar_e, ar_o, qk_scale, D, NOPE, PREC)
                if MODE == 1:
                    for start in range(0, nvis, BLOCK_N):
                        rows = start + offs_n
                        m_i, l_i, acc, sr_e, sr_o, ar_e, ar_o = _seg_tile(
                            qn, qre, qro, ent, rows, rows < nvis, (rows < nvis)[None, :], offs_d, offs_r, rmask, m_i,
                            l_i, acc, sr_e, sr_o, ar_e, ar_o, qk_scale, D, NOPE, PREC)
                if MODE == 2:
                    first = tl.load(tab_ptr + j * COLS + 5)
                    for start in range(pb, pe, BLOCK_N):
                        k = start + offs_n
                        ids = tl.load(picks_ptr + t * n_picks + k, mask=k < pe, other=-1).to(tl.int64) - first
                        ok = (k < pe) & (ids >= 0) & (ids < n_ent)
                        m_i, l_i, acc, sr_e, sr_o, ar_e, ar_o = _seg_tile(
                            qn, qre, qro, ent, ids, ok, ok[None, :], offs_d, offs_r, rmask, m_i, l_i, acc, sr_e, sr_o,
                            ar_e, ar_o, qk_scale, D, NOPE, PREC)
                # this segment's rope value sums turned back at t - Delta_j (the conjugate rotation), then kept
                ar_e += sr_e * cs + sr_o * sn
                ar_o += sr_o * cs - sr_e * sn
        sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32) * sink_scale
        _finish(o_ptr + t * (H * D) + offs_h[:, None] * D, hmask, m_i, l_i, acc, ar_e, ar_o, sink, offs_d, offs_r,
                rmask, NOPE)

    @triton.jit
    def _multiseg_packed_kernel(q_ptr, qpos_ptr, tab_ptr, picks_ptr, bounds_ptr, freq_ptr, sink_ptr, o_ptr,
                                T, H, P, window, ratio, n_picks, qk_scale, sink_scale, stride_qt, stride_qh,
                                MODE: tl.constexpr, D: tl.constexpr, HALF_R: tl.constexpr, RP: tl.constexpr,
                                COLS: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                                BLOCK_N: tl.constexpr, PREC: tl.constexpr, SPAN: tl.constexpr, PB: tl.constexpr):
        """`_multiseg_kernel` for calls of few heads: one program holds ROWS consecutive query rows x all their
        heads (matrix row m = row m // BLOCK_H, head m % BLOCK_H), so the MMA tile's rows are filled and the rows
        share their key tiles: window tiles over the union of the rows' windows, entry tiles up to the furthest
        row's visible count, each score masked to the rows that see it. Picks differ per row: each row's run is
        walked on its own, the other rows masked out."""
        NOPE: tl.constexpr = D - 2 * HALF_R
        M: tl.constexpr = ROWS * BLOCK_H
        rid, t0, hh, mmask, t, qrow, qn, pos = _query_rows(q_ptr, qpos_ptr, T, H, stride_qt, stride_qh, 0, ROWS,
                                                           BLOCK_H, D, NOPE)
        offs_d = tl.arange(0, D)
        offs_r = tl.arange(0, RP)
        rmask = offs_r < HALF_R
        offs_n = tl.arange(0, BLOCK_N)
        dt = q_ptr.dtype.element_ty
        freq = tl.load(freq_ptr + offs_r, mask=rmask, other=0.0)
        m_i, l_i, acc, ar_e, ar_o = _start(M, D, RP)
        j0 = 0
        j1 = P
        if SPAN:
            j0, j1 = _span(tab_ptr, bounds_ptr, P, T, t0, tl.min(tl.where(mmask, pos, 1 << 62), 0) - window + 1,
                           tl.max(tl.where(mmask, pos, -1), 0), MODE, ROWS, COLS, PB)
        for j in range(j0, j1):
            lat, n, delta, ent, n_ent = _segment(tab_ptr, j, COLS, dt)
            c = pos - delta                                # [M] each query row's position in segment j's frame
            lo = tl.maximum(c - window + 1, 0)
            hi = tl.minimum(c + 1, n)
            win = mmask & (hi > lo)
            lo_u = tl.min(tl.where(win, lo, n), 0)
            hi_u = tl.max(tl.where(win, hi, 0), 0)
            nvis = lo * 0
            pcount = lo * 0
            if MODE == 1:
                nvis = tl.where(mmask, tl.minimum(tl.maximum(c + 1, 0) // ratio, n_ent), 0)
            if MODE == 2:
                pb = tl.load(bounds_ptr + t * (P + 1) + j)
                pe = tl.load(bounds_ptr + t * (P + 1) + j + 1)
                pcount = tl.where(mmask, pe - pb, 0)
            nvis_u = tl.max(nvis, 0)
            if (hi_u > lo_u) | (nvis_u > 0) | (tl.max(pcount, 0) > 0):
                qre, qro, cs, sn = _turn_query(qrow, c.to(tl.float32)[:, None], freq[None, :],
                                               mmask[:, None] & rmask[None, :], offs_r, NOPE, dt)
                sr_e = tl.zeros([M, RP], dtype=tl.float32)
                sr_o = tl.zeros([M, RP], dtype=tl.float32)
                for start in range(lo_u, hi_u, BLOCK_N):
                    rows = start + offs_n
                    sv = win[:, None] & (rows[None, :] >= lo[:, None]) & (rows[None, :] < hi[:, None])
                    if tl.max(sv.to(tl.int32)) > 0:        # windows far apart: tiles between them are skipped
                        m_i, l_i, acc, sr_e, sr_o, ar_e, ar_o = _seg_tile(
                            qn, qre, qro, lat, rows, rows < hi_u, sv, offs_d, offs_r, rmask, m_i, l_i, acc, sr_e,
                            sr_o, ar_e, ar_o, qk_scale, D, NOPE, PREC)
                if MODE == 1:
                    for start in range(0, nvis_u, BLOCK_N):
                        rows = start + offs_n
                        m_i, l_i, acc, sr_e, sr_o, ar_e, ar_o = _seg_tile(
                            qn, qre, qro, ent, rows, rows < nvis_u, rows[None, :] < nvis[:, None], offs_d, offs_r,
                            rmask, m_i, l_i, acc, sr_e, sr_o, ar_e, ar_o, qk_scale, D, NOPE, PREC)
                if MODE == 2:
                    first = tl.load(tab_ptr + j * COLS + 5)
                    for r in range(ROWS):
                        tr = t0 + r
                        if tr < T:
                            rb = tl.load(bounds_ptr + tr * (P + 1) + j).to(tl.int64)
                            re = tl.load(bounds_ptr + tr * (P + 1) + j + 1).to(tl.int64)
                            mine = mmask & (rid == r)
                            for start in range(rb, re, BLOCK_N):
                                k = start + offs_n
                                ids = tl.load(picks_ptr + tr * n_picks + k, mask=k < re, other=-1).to(tl.int64)
                                ids = ids - first
                                ok = (k < re) & (ids >= 0) & (ids < n_ent)
                                m_i, l_i, acc, sr_e, sr_o, ar_e, ar_o = _seg_tile(
                                    qn, qre, qro, ent, ids, ok, mine[:, None] & ok[None, :], offs_d, offs_r, rmask,
                                    m_i, l_i, acc, sr_e, sr_o, ar_e, ar_o, qk_scale, D, NOPE, PREC)
                ar_e += sr_e * cs + sr_o * sn
                ar_o += sr_o * cs - sr_e * sn
        sink = tl.load(sink_ptr + hh, mask=hh < H, other=0.0).to(tl.float32) * sink_scale
        _finish(o_ptr + t[:, None] * (H * D) + hh[:, None] * D, mmask, m_i, l_i, acc, ar_e, ar_o, sink, offs_d,
                offs_r, rmask, NOPE)


def segment_table(segments, device, dtype, with_entries: bool, pick_first: list[int] | None = None):
    """[P, 6] int64 on `device`: per segment its latent's address, n, Delta, entries' address (0 when none), entry
    count, first global pick id (`pick_first`, by default the entries numbered globally in segment order). Returns
    (table, keep): `keep` holds any dtype-converted copies the addresses point at (alive until the kernel has run).
    The table travels from pinned memory without a stall."""
    keep, rows, n_before = [], [], 0
    for j, seg in enumerate(segments):
        lat = aligned(seg.latent if seg.latent.dtype == dtype else seg.latent.to(dtype))
        keep.append(lat)
        ent = seg.entries if with_entries else None
        if ent is not None:
            ent = aligned(ent if ent.dtype == dtype else ent.to(dtype))
            keep.append(ent)
        n_ent = 0 if ent is None else ent.shape[0]
        rows.append([lat.data_ptr() if lat.shape[0] else 0, lat.shape[0], int(seg.delta),
                     ent.data_ptr() if n_ent else 0, n_ent, n_before if pick_first is None else pick_first[j]])
        n_before += n_ent
    return to_device_nowait(torch.tensor(rows, dtype=torch.int64).reshape(-1, COLS), device), keep


def multi_segment_attention(q_raw: torch.Tensor, qpos: torch.Tensor, segments, sink: torch.Tensor, window: int,
                            mode: str, ratio: int, scale: float, inv_freq: torch.Tensor,
                            picks: torch.Tensor | None = None, pick_first: list[int] | None = None,
                            bounds: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                            config: dict | None = None, out: torch.Tensor | None = None,
                            key_frame: bool = False, turns: torch.Tensor | None = None) -> torch.Tensor:
    """q_raw [T,H,D] normed, not roped; qpos [T] request positions; segments: objects with .delta, .latent [n,D]
    and .entries [N,D] or None; sink [H]; inv_freq [rd/2] float32 (the layer's rotary). "picks": picks [T,k]
    global ids sorted ascending per row (unused: any id past every segment), pick_first[j] segment j's first
    global id, bounds [T, P+1] int32 each segment's start in the row's list (bounds[:, P] = the row's count).
    -> o [T,H,D] in out_dtype (default q's), merged with the sink, RoPE channels turned back (ready for W_a);
    written into `out` (contiguous [T,H,D] of that dtype, e.g. a caller's row slice) when given. `key_frame`:
    `_multiseg_keyframe_kernel` (the rope turn on the keys, one loop over a row's window and entry tiles across
    segments; one query row per program, fewer than 16 heads padded to 16, or KEY_ROWS // heads rows in an HCA call
    of few heads; segments in increasing Delta), the caller's rule (RuntimePolicy.key_frame_min_heads: the active
    rows' CSA calls; key_frame_min_segments_hca: HCA calls over many segments); else the query turned per segment
    (`_multiseg_kernel`, or `_multiseg_packed_kernel` for fewer than 16 heads unless a config sets ROWS = 1).
    `turns` (key frame): [P, 2, rd/2] float32, cos and sin of each segment's Delta x inv_freq (the model's angles,
    `Rotary.cos_sin`; a caller that makes them once per request passes them), else made here."""
    check_runnable(q_raw)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    T, H, D = q_raw.shape
    half_r = inv_freq.numel()
    if D & (D - 1) or D < 32 or not 0 < 2 * half_r < D:
        raise ValueError(f"head dim {D} must be a power of two >= 32 holding fewer than {D} rope channels "
                         f"({2 * half_r} given)")
    if mode == "picks" and (picks is None or bounds is None or pick_first is None):
        raise ValueError("mode 'picks' needs picks, pick_first and bounds")
    dev = q_raw.device
    dt = out_dtype or q_raw.dtype
    if out is None:
        out = torch.empty((T, H, D), dtype=dt, device=dev)
    elif out.shape != (T, H, D) or out.dtype != dt or not out.is_contiguous() or out.device != dev:
        raise ValueError(f"out must be a contiguous {(T, H, D)} {dt} tensor on {dev}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    if T == 0:
        return out
    if q_raw.stride(-1) != 1:
        q_raw = q_raw.contiguous()
    bh = triton.next_power_of_2(H)
    packed = not key_frame and bh < 16 and (config or {}).get("ROWS", 16 // bh) > 1
    rows = (config or {}).get("ROWS", 1)
    if rows > 1 and rows * (config or {}).get("BLOCK_H", bh) < 16:
        raise ValueError(f"ROWS={rows} x {bh} heads fills fewer than the 16 rows a tile needs")
    if key_frame and any(a.delta > b.delta for a, b in zip(segments, segments[1:])):
        raise ValueError("the key-frame kernel needs the segments in increasing Delta")
    tab, keep = segment_table(segments, dev, q_raw.dtype, mode != "none", pick_first)
    # segments in increasing Delta, disjoint: a program walks only the segments its rows reach (`_span`)
    span = all(a.delta + a.latent.shape[0] <= b.delta for a, b in zip(segments, segments[1:]))
    pb = max(16, triton.next_power_of_2(len(segments)))
    if mode == "picks":
        picks = picks.to(device=dev, dtype=torch.int32).contiguous()
        bounds = bounds.to(device=dev, dtype=torch.int32).contiguous()
        assert bounds.shape == (T, len(segments) + 1), (bounds.shape, T, len(segments))
        n_picks = picks.shape[1]
    else:
        picks = bounds = qpos
        n_picks = 0
    qpos = qpos.to(device=dev, dtype=torch.int64).contiguous()
    inv_freq = inv_freq.to(device=dev, dtype=torch.float32).contiguous()
    sink = sink.to(device=dev, dtype=torch.float32).contiguous()
    ptrs = (q_raw, qpos, tab, picks, bounds, inv_freq, sink, out)
    scalars = (len(segments), int(window), max(int(ratio), 1), n_picks, float(scale) * LOG2E, LOG2E,
               q_raw.stride(0), q_raw.stride(1))
    shape = dict(MODE=MODES[mode], D=D, HALF_R=half_r, RP=max(16, triton.next_power_of_2(half_r)), COLS=COLS,
                 PREC=dot_precision(q_raw.dtype))
    if packed:
        # few heads: several rows per program (_multiseg_packed_kernel), ROWS x heads filling the MMA tile
        cfg = dict(ROWS=16 // bh, BLOCK_N=32 if D >= 512 else 16, num_warps=4, num_stages=2)
        cfg.update(config or {})
        _multiseg_packed_kernel[(triton.cdiv(T, cfg["ROWS"]),)](*ptrs, T, H, *scalars, **shape, BLOCK_H=bh, **cfg,
                                                                  SPAN=span, PB=pb)
    elif key_frame:
        # one row per program (heads padded to 16), or for an HCA call of few heads KEY_ROWS rows x all heads: the
        # rows share every entry tile of the causal run
        rows = (config or {}).get("ROWS", KEY_ROWS // bh if mode == "causal" and bh < 16 else 1)
        cfg = dict(ROWS=rows, BLOCK_H=bh if rows > 1 else min(64, max(16, bh)), BLOCK_N=64 if D >= 512 else 16,
                   num_warps=8 if D >= 512 and rows * H > 16 else 4, num_stages=2)
        cfg.update(config or {})
        if turns is None:
            ang = to_device_nowait(torch.tensor([s.delta for s in segments], dtype=torch.long), dev).float()[:, None] \
                * inv_freq[None, :]
            turns = torch.stack((ang.cos(), ang.sin()), dim=1)
        if turns.shape != (len(segments), 2, half_r) or turns.dtype != torch.float32:
            raise ValueError(f"turns must be float32 {(len(segments), 2, half_r)}, got {turns.dtype} "
                             f"{tuple(turns.shape)}")
        grid = (triton.cdiv(T, cfg["ROWS"]), triton.cdiv(H, cfg["BLOCK_H"]))
        _multiseg_keyframe_kernel[grid](*ptrs, turns.to(dev).contiguous(), T, H, *scalars, **shape, **cfg, PB=pb)
    else:
        cfg = dict(BLOCK_H=min(64, max(16, bh)), BLOCK_N=64 if D >= 512 else 16,
                   num_warps=8 if D >= 512 and H > 16 else 4, num_stages=2)
        cfg.update({k: v for k, v in (config or {}).items() if k != "ROWS"})
        _multiseg_kernel[(T, triton.cdiv(H, cfg["BLOCK_H"]))](*ptrs, H, *scalars, **shape, **cfg, SPAN=span, PB=pb)
    del keep
    return out
