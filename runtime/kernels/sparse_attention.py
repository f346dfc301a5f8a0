"""Sparse MQA attention over one segment: window rows of the shared K=V latent plus compressed entries
(all causally visible ones, HCA; or per-row picks, CSA), with an online softmax in float32.

Reference semantics (runtime/model/deepseek_v4.py `window_attention`, `entry_attention`, `gathered_attention`,
and runtime/reuse/segments.py `_window_part`), merged by log-sum-exp WITHOUT the sink:

- window: query t sees key rows cpos[t]-W+1 .. cpos[t], clipped to [0, n);
- mode "causal": entry w is visible iff w < (cpos[t]+1) // ratio;
- mode "picks": entries picks[t, :] (-1 = none);
- mode "none": window only.

K = V: one latent row serves as key and value for every head (MQA). Returns the normalized output o [T,H,D]
float32 and the natural-log LSE [T,H] float32 (-inf, with o = 0, where a row saw no key). The sink is applied
once after all parts are merged (`merge_lse`).

Kernel design: one program per (query row, block of BLOCK_H heads). The program streams BLOCK_N key rows at a
time; each key tile is loaded once and used by all BLOCK_H heads for both products (S = Q K^T on [BLOCK_H, D] x
[D, BLOCK_N], then O += P K on [BLOCK_H, BLOCK_N] x [BLOCK_N, D]), which is the MQA sharing that makes the
work matrix-shaped (M = heads). Scores are scaled into the log2 domain and the softmax runs in float32.

Calls of few heads (8 or fewer: the reuse consumer's Global heads) in modes "none" and "causal" take
`_sparse_mqa_rows_kernel` (`packed_rows`): ROWS query rows x the heads per program, ROWS x heads = 64, so the MMA tile's rows are filled and each key tile serves ROWS rows (their windows overlap,
their causal entries are shared), each score masked to the rows that see its key. Per-row picks share nothing,
so "picks" keeps one row per program.

Known limit (docs/BENCHMARKS.md, "GPU kernels"): at BLOCK_H = 64 with 8 warps Triton places all warps along M for
S = Q K^T (it feeds a second dot), so the two warpgroups both compute S; P K is split between them. About 1.5x
the useful tensor work is executed; the kernel reaches ~30% of the bf16 rate at D = 512, H = 64.
"""
from __future__ import annotations

import math

import torch

from ._triton import HAVE_TRITON, check_runnable, dot_precision, tl, triton

if HAVE_TRITON:
    from ._triton import online_step, table_ptr

MODES = {"none": 0, "causal": 1, "picks": 2}
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2

if HAVE_TRITON:

    @triton.jit
    def _online_block(q, k, v, valid, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
        """One key tile: q [BH, D], k [BN, D], v [BN, DV] (K = V: v is k or its column slice), valid [1, BN]
        (every query row sees the same keys) or [BH, BN] (which query row sees which key); the softmax state is
        kept in the log2 domain. PREC: the dots' input precision (see `dot_precision`)."""
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale                             # [BH, BN] fp32
        m_new, l_i, p, alpha = online_step(s, valid, m_i, l_i, v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        return m_new, l_i, acc

    @triton.jit
    def _normalized(m_i, l_i, acc):
        """The online softmax's result: o = acc / l and the natural-log LSE, -inf (with o = 0) where a row saw no
        key."""
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        return acc / l_safe[:, None], lse

    @triton.jit
    def _tile(base_ptr, rows, valid, offs_d, offs_v, D: tl.constexpr, DV: tl.constexpr):
        """Key tile [BN, D] and its value columns [BN, DV] (the same tile when DV == D)."""
        ptr = base_ptr + rows[:, None].to(tl.int64) * D
        k = tl.load(ptr + offs_d[None, :], mask=valid[:, None], other=0.0)
        if DV == D:
            v = k
        else:
            v = tl.load(ptr + offs_v[None, :], mask=valid[:, None], other=0.0)
        return k, v

    @triton.jit
    def _part_row(prog_ptr, i):
        """Row i of a parts launch's program table (int64 [., 4]): its part, its (first) query row t, v, that row's
        place in the call's angle table, and the end of the part's rows."""
        row = prog_ptr + i * 4
        return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)

    @triton.jit
    def _part_segment(tab_ptr, part, dt: tl.constexpr):
        """A part's segment (multiseg.segment_table's row: latent address, n, Delta, entries address, entry
        count, first global pick id): its latent and entries as pointers, their counts, its Delta and the global
        id of its first entry."""
        row = tab_ptr + part * 6
        return (table_ptr(tl.load(row), dt), tl.load(row + 1), table_ptr(tl.load(row + 3), dt), tl.load(row + 4),
                tl.load(row + 2), tl.load(row + 5))

    @triton.jit
    def _turned(q, base, qmask, cos_ptr, sin_ptr, v, offs_d, D: tl.constexpr, HALF: tl.constexpr):
        """q [R, D] (rows at `base` + channel) with its trailing 2 x HALF channels turned by the interleaved pairs
        (2i, 2i+1) at the angles of row v[r] of cos/sin [., HALF] (float32), rounded to q's dtype: the arithmetic
        of `rope_` (runtime/kernels/rope.py). Each channel's pair partner is read again from memory (a cache
        hit), so nothing is shuffled between registers; the other channels are left exact."""
        RO: tl.constexpr = D - 2 * HALF
        rope = (offs_d >= RO)[None, :]
        pair = tl.where(offs_d >= RO, (offs_d - RO) // 2, 0)[None, :]
        ang = v[:, None] * HALF + pair
        c = tl.load(cos_ptr + ang, mask=qmask & rope, other=1.0)
        s = tl.load(sin_ptr + ang, mask=qmask & rope, other=0.0)
        s = tl.where((offs_d % 2 == 0)[None, :], -s, s)
        partner = tl.load(base + (offs_d ^ 1)[None, :], mask=qmask & rope, other=0.0)
        return (q.to(tl.float32) * c + partner.to(tl.float32) * s).to(q.dtype)

    @triton.jit
    def _sparse_mqa_kernel(q_ptr, k_ptr, e_ptr, cpos_ptr, picks_ptr, o_ptr, lse_ptr,
                           H, n_keys, n_entries, n_picks, ratio, window, qk_scale, pos_shift,
                           stride_qt, stride_qh, stride_pt,
                           tab_ptr, prog_ptr, cos_ptr, sin_ptr, stride_op, stride_lp, runs_ptr, stride_rt,
                           n_parts,
                           MODE: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_N: tl.constexpr, PREC: tl.constexpr, PARTS: tl.constexpr, HALF: tl.constexpr,
                           RUNS: tl.constexpr):
        """PARTS: one launch over many segments' parts (`sparse_mqa_parts`): program i is the query row that
        prog_ptr's row i names in its part, whose segment row in tab_ptr gives the keys, entries and Delta; its
        query is turned to t - Delta on load (cos/sin of the part's row), its picks are row t of picks_ptr as
        global entry ids (the segment's own: first .. first + n_entries - 1, the others skipped), its output and
        LSE go to the part's slice of the stacked buffers (o_ptr + part x stride_op). RUNS: row t's picks are
        sorted ascending and runs_ptr [T, 2 x n_parts] holds where each part's segment's run starts and ends in
        it (columns part and n_parts + part): the program reads that run only, not every slot of the row."""
        hb = tl.program_id(1)
        offs_v = tl.program_id(2) * DV + tl.arange(0, DV)                 # this program's output columns
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        if PARTS:
            i = tl.program_id(0).to(tl.int64)
            part, t, arow, _ = _part_row(prog_ptr, i)
            k_ptr, n_keys, e_ptr, n_entries, delta, pick_first = _part_segment(tab_ptr, part,
                                                                                q_ptr.dtype.element_ty)
            cp = (tl.load(cpos_ptr + t) - delta).to(tl.int32)          # cpos_ptr: the request positions
            o_ptr += part * stride_op
            lse_ptr += part * stride_lp
        else:
            t = tl.program_id(0).to(tl.int64)
            cp = tl.load(cpos_ptr + t).to(tl.int32)
            pick_first = 0
        q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=hmask[:, None], other=0.0)
        if PARTS:
            q = _turned(q, q_ptr + t * stride_qt + offs_h[:, None] * stride_qh, hmask[:, None], cos_ptr, sin_ptr,
                        arow + tl.zeros([BLOCK_H], tl.int64), offs_d, D, HALF)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)

        # window rows cpos-W+1 .. cpos, clipped to [0, n_keys)
        lo = tl.maximum(cp - window + 1, 0)
        hi = tl.minimum(cp + 1, n_keys)
        for start in range(lo, hi, BLOCK_N):
            rows = start + offs_n
            valid = rows < hi
            k, v = _tile(k_ptr, rows, valid, offs_d, offs_v, D, DV)
            m_i, l_i, acc = _online_block(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, PREC)

        if MODE == 1:
            # every entry complete before the query: w < (cpos+1)//ratio (an empty range when cpos+1 <= 0)
            # (the query's position is cp + pos_shift: the keys may start after position 0)
            nvis = tl.minimum(tl.maximum(cp + pos_shift + 1, 0) // ratio, n_entries)
            for start in range(0, nvis, BLOCK_N):
                rows = start + offs_n
                valid = rows < nvis
                k, v = _tile(e_ptr, rows, valid, offs_d, offs_v, D, DV)
                m_i, l_i, acc = _online_block(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, PREC)
        elif MODE == 2:
            k_lo = 0
            k_hi = n_picks
            if RUNS:
                k_lo = tl.load(runs_ptr + t * stride_rt + part).to(tl.int32)
                k_hi = tl.load(runs_ptr + t * stride_rt + n_parts + part).to(tl.int32)
            for start in range(k_lo, k_hi, BLOCK_N):
                j = start + offs_n
                idx = tl.load(picks_ptr + t * stride_pt + j, mask=j < k_hi, other=-1) - pick_first
                valid = (idx >= 0) & (idx < n_entries)
                k, v = _tile(e_ptr, idx, valid, offs_d, offs_v, D, DV)
                m_i, l_i, acc = _online_block(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, PREC)

        o, lse = _normalized(m_i, l_i, acc)
        o_rows = t * (H * D) + offs_h[:, None] * D + offs_v[None, :]
        tl.store(o_ptr + o_rows, o, mask=hmask[:, None])
        if tl.program_id(2) == 0:
            tl.store(lse_ptr + t * H + offs_h, lse, mask=hmask)


    @triton.jit
    def _sparse_mqa_rows_kernel(q_ptr, k_ptr, e_ptr, cpos_ptr, o_ptr, lse_ptr,
                                T, H, n_keys, n_entries, ratio, window, qk_scale, pos_shift, stride_qt, stride_qh,
                                tab_ptr, prog_ptr, cos_ptr, sin_ptr, stride_op, stride_lp,
                                MODE: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                                BLOCK_N: tl.constexpr, PREC: tl.constexpr, PARTS: tl.constexpr,
                                HALF: tl.constexpr):
        """`_sparse_mqa_kernel` for calls of few heads in modes "none" and "causal": one program holds ROWS
        query rows x BLOCK_H heads (matrix row m: query row t0 + m // BLOCK_H, head m % BLOCK_H), so the MMA tile's
        M = ROWS x BLOCK_H rows are filled (8 heads alone fill half of a 16-row tile) and each key tile, read once,
        serves every row of the block: the union of the rows' windows, then every entry visible to one of them,
        each score masked to the rows that see its key. The rows' positions need not be consecutive (a gap only
        widens the union). PARTS: one launch over many segments' parts, as `_sparse_mqa_kernel`'s (program i:
        ROWS consecutive rows of one part from row i of prog_ptr, its last row the part's end T)."""
        M: tl.constexpr = ROWS * BLOCK_H
        offs_m = tl.arange(0, M)
        h = tl.program_id(1) * BLOCK_H + offs_m % BLOCK_H
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        if PARTS:
            part, t0, v0, end = _part_row(prog_ptr, tl.program_id(0).to(tl.int64))
            k_ptr, n_keys, e_ptr, n_entries, delta, _ = _part_segment(tab_ptr, part, q_ptr.dtype.element_ty)
            t = t0 + offs_m // BLOCK_H
            tmask = t < end
        else:
            t = tl.program_id(0).to(tl.int64) * ROWS + offs_m // BLOCK_H
            tmask = t < T
        mmask = tmask & (h < H)
        q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                    mask=mmask[:, None], other=0.0)
        if PARTS:
            q = _turned(q, q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh, mmask[:, None], cos_ptr,
                        sin_ptr, v0 + offs_m // BLOCK_H, offs_d, D, HALF)
            cp = (tl.load(cpos_ptr + t, mask=tmask, other=0) - delta).to(tl.int32)
            o_ptr += part * stride_op
            lse_ptr += part * stride_lp
        else:
            cp = tl.load(cpos_ptr + t, mask=tmask, other=0).to(tl.int32)                  # [M]
        cp_min = tl.min(tl.where(tmask, cp, 2147483647), 0)
        cp_max = tl.max(tl.where(tmask, cp, -2147483647), 0)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], dtype=tl.float32)
        acc = tl.zeros([M, D], dtype=tl.float32)

        # window rows cp-W+1 .. cp of each query row, clipped to [0, n_keys): the union, masked per row
        lo = tl.maximum(cp_min - window + 1, 0)
        hi = tl.minimum(cp_max + 1, n_keys)
        for start in range(lo, hi, BLOCK_N):
            rows = start + offs_n
            valid = rows < hi
            k = tl.load(k_ptr + rows[:, None].to(tl.int64) * D + offs_d[None, :], mask=valid[:, None], other=0.0)
            sees = valid[None, :] & (rows[None, :] <= cp[:, None]) & (rows[None, :] > cp[:, None] - window)
            m_i, l_i, acc = _online_block(q, k, k, sees, m_i, l_i, acc, qk_scale, PREC)

        if MODE == 1:
            nvis = tl.minimum(tl.maximum(cp + pos_shift + 1, 0) // ratio, n_entries)             # [M]
            nvis_max = tl.max(tl.where(tmask, nvis, 0), 0)
            for start in range(0, nvis_max, BLOCK_N):
                rows = start + offs_n
                valid = rows < nvis_max
                k = tl.load(e_ptr + rows[:, None].to(tl.int64) * D + offs_d[None, :], mask=valid[:, None],
                            other=0.0)
                m_i, l_i, acc = _online_block(q, k, k, valid[None, :] & (rows[None, :] < nvis[:, None]), m_i, l_i,
                                              acc, qk_scale, PREC)

        o, lse = _normalized(m_i, l_i, acc)
        tl.store(o_ptr + t[:, None] * (H * D) + h[:, None] * D + offs_d[None, :], o, mask=mmask[:, None])
        tl.store(lse_ptr + t * H + h, lse, mask=mmask)


def packed_rows(H: int, mode: str) -> int:
    """Query rows per program for a call of H heads in `mode`: several rows (`_sparse_mqa_rows_kernel`) where the
    heads alone leave most of the MMA tile idle (8 heads or fewer: the reuse consumer's Global heads) and the rows
    share their keys (modes "none" and "causal"; "picks" differ per row), so that ROWS x heads = 64 (at most 16
    rows); else one row per program. A config's ROWS overrides it (the kernel tests run both kernels)."""
    if mode == "picks" or not HAVE_TRITON:
        return 1
    bh = triton.next_power_of_2(H)
    return min(16, 64 // bh) if bh <= 8 else 1


def default_config(H: int, D: int) -> dict:
    """Block sizes per shape. BLOCK_H = the heads of one program (the matrix M dimension). At D = 512, H = 64 on
    an H200 (bench/kernels.py --tune, 2026-11-29): BLOCK_N 64 5.7 ms, 32 7.3 ms; DV = 256 13.6 ms; BLOCK_H 32
    9.5 ms, 16 9.1 ms (T = 16K rows, window + 512 picks)."""
    bh = min(64, max(16, triton.next_power_of_2(H))) if HAVE_TRITON else 64
    if D >= 512:
        return dict(BLOCK_H=bh, BLOCK_N=64, num_warps=4 if bh <= 16 else 8, num_stages=2)
    return dict(BLOCK_H=bh, BLOCK_N=64, num_warps=4, num_stages=2)


def _row_config(H: int, D: int, config: dict | None) -> tuple[dict, int]:
    """`_sparse_mqa_kernel`'s launch configuration (one query row per program; a config's entries override the
    defaults) and DV, its output columns per program (DV < D recomputes S per slice)."""
    cfg = dict(default_config(H, D), **({k: v for k, v in (config or {}).items() if k != "ROWS"}))
    DV = min(int(cfg.get("DV", D)), D)
    if D % DV or DV & (DV - 1):
        raise ValueError(f"DV={DV} must be a power of two dividing D={D}")
    return cfg, DV


def _rows_config(H: int, D: int, rows: int, mode: str, config: dict | None) -> dict:
    """`_sparse_mqa_rows_kernel`'s launch configuration for `rows` query rows per program (a config's entries
    override the defaults)."""
    if mode == "picks" or rows & (rows - 1):
        raise ValueError(f"ROWS={rows} needs mode none or causal and a power of two")
    bh = triton.next_power_of_2(H)
    cfg = dict(BLOCK_H=bh, BLOCK_N=64 if D >= 512 else 16, num_warps=8 if D >= 512 and rows * bh >= 64 else 4,
               num_stages=2)
    cfg.update({k: v for k, v in (config or {}).items() if k != "ROWS"})
    if rows * cfg["BLOCK_H"] < 16:
        raise ValueError(f"ROWS x BLOCK_H = {rows * cfg['BLOCK_H']}: a dot needs at least 16 matrix rows")
    return cfg


def sparse_mqa_attention(q: torch.Tensor, keys: torch.Tensor, cpos: torch.Tensor, window: int,
                         entries: torch.Tensor | None = None, mode: str = "none", ratio: int = 1,
                         picks: torch.Tensor | None = None, scale: float | None = None,
                         config: dict | None = None,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None,
                         pos_shift: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T,H,D] (roped, bf16/fp16), keys [n,D], cpos [T] (query position in the keys' frame), window W,
    entries [N,D] or None, mode "none" | "causal" | "picks", ratio (causal), picks [T,k] int (-1 = none),
    scale (default D^-0.5) -> (o [T,H,D] float32 normalized, lse [T,H] float32 natural log, -inf where no key).
    `out`: contiguous (o [T,H,D] float32, lse [T,H] float32) to write into (a slice of a caller's buffer).
    `pos_shift`: the query's position minus cpos, for "causal" (entries complete before position p: (p+1)//ratio)
    when the keys do not start at position 0 (a cache that keeps only the window's last rows)."""
    check_runnable(q)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    T, H, D = q.shape
    if D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two")
    if keys.dim() != 2 or keys.shape[1] != D:
        raise ValueError(f"keys must be [n, {D}], got {tuple(keys.shape)}")
    scale = D ** -0.5 if scale is None else float(scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    keys = keys.to(q.dtype).contiguous()
    cpos = cpos.to(device=q.device).contiguous()
    if mode != "none":
        if entries is None:
            raise ValueError(f"mode {mode!r} needs entries")
        entries = entries.to(q.dtype).contiguous()
    e = entries if entries is not None and entries.shape[0] else keys     # any valid pointer when unused
    n_entries = 0 if entries is None else entries.shape[0]
    if mode == "picks":
        if picks is None:
            raise ValueError("mode 'picks' needs picks [T, k]")
        picks = picks.to(device=q.device, dtype=torch.int32).contiguous()
        n_picks, stride_pt = picks.shape[1], picks.stride(0)
        p = picks if picks.numel() else cpos
    else:
        n_picks, stride_pt, p = 0, 0, cpos
    if mode == "causal" and ratio < 1:
        raise ValueError("causal mode needs ratio >= 1")

    if out is None:
        o = torch.empty((T, H, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    else:
        o, lse = out
        assert o.shape == (T, H, D) and lse.shape == (T, H) and o.dtype == lse.dtype == torch.float32, \
            (o.shape, lse.shape, o.dtype)
        assert o.is_contiguous() and lse.is_contiguous(), "out buffers must be contiguous"
    if T == 0:
        return o, lse
    k_arg = keys if keys.shape[0] else q                                # n = 0: the window loop never runs
    rows = int((config or {}).get("ROWS", packed_rows(H, mode)))
    if rows > 1:                                # several query rows per program (few heads, shared keys)
        cfg = _rows_config(H, D, rows, mode, config)
        _sparse_mqa_rows_kernel[(triton.cdiv(T, rows), triton.cdiv(H, cfg["BLOCK_H"]))](
            q, k_arg, e, cpos, o, lse, T, H, keys.shape[0], n_entries, max(int(ratio), 1), int(window),
            scale * LOG2E, int(pos_shift), q.stride(0), q.stride(1), cpos, cpos, o, o, 0, 0, MODE=MODES[mode], D=D,
            ROWS=rows, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], PREC=dot_precision(q.dtype), PARTS=False,
            HALF=1, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return o, lse
    cfg, DV = _row_config(H, D, config)
    grid = (T, triton.cdiv(H, cfg["BLOCK_H"]), D // DV)
    _sparse_mqa_kernel[grid](q, k_arg, e, cpos, p, o, lse,
                             H, keys.shape[0], n_entries, n_picks, max(int(ratio), 1), int(window),
                             scale * LOG2E, int(pos_shift), q.stride(0), q.stride(1), stride_pt,
                             cpos, cpos, o, o, 0, 0, cpos, 0, 0,
                             MODE=MODES[mode], D=D, DV=DV, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"],
                             PREC=dot_precision(q.dtype), PARTS=False, HALF=1, RUNS=False,
                             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return o, lse


def sparse_mqa_parts(q: torch.Tensor, qpos: torch.Tensor, tab: torch.Tensor, prog: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, o_buf: torch.Tensor, lse_buf: torch.Tensor, window: int, ratio: int,
                     scale: float, mode: str, picks: torch.Tensor | None = None, rows: int = 1,
                     config: dict | None = None, runs: torch.Tensor | None = None) -> None:
    """Many segments' parts of one call in one launch (runtime/reuse/segments.py's stacked path), whatever their
    number: part p attends segment p of `tab` (multiseg.segment_table's rows: latent, n, Delta, entries and their
    count, 0 where the part attends none) from some of the query rows, with the query's rope channels turned to
    t - Delta as they are loaded.

    q [T,H,D] normed, not turned; qpos [T] int64 request positions; prog [N,4] int64 per program (part, first
    query row, that row's angle row, the part's end row), ROWS rows per program (`rows`, 1 for "picks"); cos/sin
    [V, HALF] float32 the angles of every (part, row) at t - Delta; o_buf [P,T,H,D], lse_buf [P,T,H] float32:
    each part's rows written in its slice, the output's rope channels NOT yet turned back. mode "causal" (entries
    complete before the row: (t - Delta + 1) // ratio; a part whose table row has no entries: the window only) or
    "picks" (picks [T, k] int: each query row's picks as global entry ids over every segment, the table's
    first-pick column numbering each segment's; ids outside a part's segment are skipped by its programs).
    `runs` (int64 [T, 2P], "picks" only): picks sorted ascending per row, and per row where each part's segment's
    ids start (column p) and end (column P + p) in it, so a part's programs read their run alone (`part_runs`)."""
    check_runnable(q)
    T, H, D = q.shape
    P = o_buf.shape[0]
    assert o_buf.shape == (P, T, H, D) and lse_buf.shape == (P, T, H), (o_buf.shape, lse_buf.shape, q.shape)
    assert o_buf.dtype == lse_buf.dtype == torch.float32 and o_buf.is_contiguous() and lse_buf.is_contiguous()
    assert prog.dtype == torch.int64 and prog.dim() == 2 and prog.shape[1] == 4, prog.shape
    assert mode in ("causal", "picks"), mode
    half = cos.shape[-1]
    if D & (D - 1) or (half & (half - 1)) or not 0 < 2 * half < D:
        raise ValueError(f"head dim {D} and rope pairs {half} must be powers of two, {2 * half} < {D}")
    N = prog.shape[0]
    if N == 0 or H == 0:
        return
    if q.stride(-1) != 1:
        q = q.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    qpos = qpos.to(device=q.device, dtype=torch.int64).contiguous()
    args = (tab, prog, cos, sin, o_buf.stride(0), lse_buf.stride(0))
    if rows > 1:
        cfg = _rows_config(H, D, rows, mode, config)
        _sparse_mqa_rows_kernel[(N, triton.cdiv(H, cfg["BLOCK_H"]))](
            q, q, q, qpos, o_buf, lse_buf, T, H, 0, 0, max(int(ratio), 1), int(window), scale * LOG2E, 0,
            q.stride(0), q.stride(1), *args, MODE=1, D=D, ROWS=rows, BLOCK_H=cfg["BLOCK_H"],
            BLOCK_N=cfg["BLOCK_N"], PREC=dot_precision(q.dtype), PARTS=True, HALF=half, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
        return
    if mode == "picks":
        assert picks is not None and picks.shape[0] == T, (None if picks is None else picks.shape, T)
        picks = picks.to(device=q.device, dtype=torch.int32).contiguous()
        n_picks, stride_pt, p = picks.shape[1], picks.stride(0), (picks if picks.numel() else prog)
    else:
        n_picks, stride_pt, p = 0, 0, prog
    if runs is not None:
        assert mode == "picks" and runs.shape == (T, 2 * P) and runs.is_contiguous(), (runs.shape, T, P)
    cfg, DV = _row_config(H, D, config)
    _sparse_mqa_kernel[(N, triton.cdiv(H, cfg["BLOCK_H"]), D // DV)](
        q, q, q, qpos, p, o_buf, lse_buf, H, 0, 0, n_picks, max(int(ratio), 1), int(window), scale * LOG2E, 0,
        q.stride(0), q.stride(1), stride_pt, *args, prog if runs is None else runs,
        0 if runs is None else runs.stride(0), P, MODE=MODES[mode], D=D, DV=DV, BLOCK_H=cfg["BLOCK_H"],
        BLOCK_N=cfg["BLOCK_N"], PREC=dot_precision(q.dtype), PARTS=True, HALF=half, RUNS=runs is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
