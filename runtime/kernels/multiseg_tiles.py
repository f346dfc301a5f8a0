"""The building blocks of the fused multi-segment kernels (runtime/kernels/multiseg.py, the query frame, and
runtime/kernels/keyframe.py, the key frame): one key tile of a segment, the online softmax's state, a segment's table
row and the span of segments a program's rows reach, the query's rope turn, the sink merge and store, and a
program's rows x heads as one matrix. Triton functions only; multiseg.py's docstring says what they compute."""
from __future__ import annotations

from ._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from ._triton import online_step, table_ptr

    @triton.jit
    def _seg_tile(qn, qre, qro, base, rows, valid, svalid, offs_d, offs_r, rmask, m_i, l_i, acc, sr_e, sr_o, ar_e,
                  ar_o, qk_scale, D: tl.constexpr, NOPE: tl.constexpr, PREC: tl.constexpr):
        """One key tile of segment j. The tile is read contiguously (all D channels) for the scores' non-rope part
        and the value sum; its rope pairs are read again as even/odd halves (a cache hit) for the rope part of the
        score and of the value sum. qn: the query with its rope channels zeroed; qre/qro: its rope pairs turned
        to t - Delta_j. sr_*: this segment's rope value sums; ar_*: the earlier segments' (already turned back).
        K = V; online softmax in the log2 domain, shared by every segment of the row. valid [N]: the key rows to
        read; svalid [M, N] (or [1, N]): which query row attends which of them."""
        ptr = base + rows[:, None].to(tl.int64) * D
        k = tl.load(ptr + offs_d[None, :], mask=valid[:, None], other=0.0)
        rp = ptr + NOPE + 2 * offs_r[None, :]
        ke = tl.load(rp, mask=valid[:, None] & rmask[None, :], other=0.0)
        ko = tl.load(rp + 1, mask=valid[:, None] & rmask[None, :], other=0.0)
        s = tl.dot(qn, tl.trans(k), input_precision=PREC)
        s = tl.dot(qre, tl.trans(ke), s, input_precision=PREC)
        s = tl.dot(qro, tl.trans(ko), s, input_precision=PREC) * qk_scale
        m_new, l_i, pk, alpha = online_step(s, svalid, m_i, l_i, k.dtype)
        acc = acc * alpha[:, None] + tl.dot(pk, k, input_precision=PREC)       # rope channels unused
        sr_e = sr_e * alpha[:, None] + tl.dot(pk, ke, input_precision=PREC)
        sr_o = sr_o * alpha[:, None] + tl.dot(pk, ko, input_precision=PREC)
        ar_e = ar_e * alpha[:, None]
        ar_o = ar_o * alpha[:, None]
        return m_new, l_i, acc, sr_e, sr_o, ar_e, ar_o

    @triton.jit
    def _start(M: tl.constexpr, D: tl.constexpr, RP: tl.constexpr):
        """The online softmax's state for M query rows: running max, denominator, value sums (all D channels; the
        rope ones unused), and the earlier segments' turned-back rope value sums (even and odd halves)."""
        return (tl.full([M], float("-inf"), tl.float32), tl.zeros([M], dtype=tl.float32),
                tl.zeros([M, D], dtype=tl.float32), tl.zeros([M, RP], dtype=tl.float32),
                tl.zeros([M, RP], dtype=tl.float32))

    @triton.jit
    def _segment(tab_ptr, j, COLS: tl.constexpr, dt: tl.constexpr):
        """Segment j's table row: its latent (pointer), length, Delta, entries (pointer) and entry count."""
        row = tab_ptr + j * COLS
        return (table_ptr(tl.load(row), dt), tl.load(row + 1), tl.load(row + 2), table_ptr(tl.load(row + 3), dt),
                tl.load(row + 4))

    @triton.jit
    def _segment_range(tab_ptr, P, COL: tl.constexpr, lo, hi, COLS: tl.constexpr, PB: tl.constexpr):
        """[j0, j1): the segments, in increasing order of the start in column COL of the table (Delta, or the first
        global entry id), that hold a key from lo to hi: from the last one starting at or before lo (the first if
        none) to the last one starting at or before hi. One masked load of the starts and two counts."""
        offs_p = tl.arange(0, PB)
        starts = tl.load(tab_ptr + offs_p * COLS + COL, mask=offs_p < P, other=1 << 62)
        return (tl.maximum(tl.sum((starts <= lo).to(tl.int32), 0) - 1, 0),
                tl.sum((starts <= hi).to(tl.int32), 0))

    @triton.jit
    def _span(tab_ptr, bounds_ptr, P, T, t0, p_lo, p_hi, MODE: tl.constexpr, ROWS: tl.constexpr,
              COLS: tl.constexpr, PB: tl.constexpr):
        """[j0, j1): the only segments that can hold a key of query rows t0..t0+ROWS-1 (rows past T ignored) whose
        keys lie at request positions p_lo..p_hi (windows included), for segments in increasing Delta and disjoint
        (the caller's SPAN): from the segment holding p_lo (causal: the first, every earlier entry is visible) to the
        one holding p_hi, widened to each row's first and last segment with picks (bounds). One masked load of
        the table's Deltas and of each row's bounds, and a count, instead of a pass over every segment: a row of
        a 64-document request reaches two or three of its 66 segments."""
        j0, j1 = _segment_range(tab_ptr, P, 2, p_lo, p_hi, COLS, PB)
        if MODE == 1:
            j0 = j1 * 0
        if MODE == 2:
            offs_p = tl.arange(0, PB)
            pm = offs_p < P
            for r in range(ROWS):
                tr = t0 + r
                brow = bounds_ptr + tl.minimum(tr, T - 1) * (P + 1)
                b0 = tl.load(brow)
                cnt = tl.load(brow + P)
                # runs before the first pick end at b0; runs from the last one's segment on start at cnt
                lead = tl.sum((tl.load(brow + 1 + offs_p, mask=pm, other=cnt) <= b0).to(tl.int32), 0)
                upto = tl.sum((tl.load(brow + offs_p, mask=pm, other=cnt) < cnt).to(tl.int32), 0)
                has = (tr < T) & (cnt > b0)
                j0 = tl.where(has, tl.minimum(j0, lead), j0)
                j1 = tl.where(has, tl.maximum(j1, upto), j1)
        return j0, j1

    @triton.jit
    def _turn_query(qrow, c, freq, qm, offs_r, NOPE: tl.constexpr, dt: tl.constexpr):
        """The query's rope pairs (even and odd halves) turned to the segment's frame (positions c, [M, 1] or
        scalar); returns them in the key dtype with the angles' cosines and sines (for turning the sums back)."""
        ang = c * freq
        cs = tl.cos(ang)
        sn = tl.sin(ang)
        qe = tl.load(qrow + NOPE + 2 * offs_r[None, :], mask=qm, other=0.0).to(tl.float32)
        qo = tl.load(qrow + NOPE + 2 * offs_r[None, :] + 1, mask=qm, other=0.0).to(tl.float32)
        return (qe * cs - qo * sn).to(dt), (qo * cs + qe * sn).to(dt), cs, sn

    @triton.jit
    def _finish(orow, rmask_rows, m_i, l_i, acc, ar_e, ar_o, sink, offs_d, offs_r, rmask, NOPE: tl.constexpr):
        """The sink's exp(sink) joins the denominator once (log2 domain: 2^(sink log2e - m)); the normalized
        output is stored, its rope pairs from the turned-back sums."""
        m_safe = tl.maximum(m_i, sink)
        keep = tl.exp2(m_i - m_safe)
        scale_out = keep / (l_i * keep + tl.exp2(sink - m_safe))
        scale_out = tl.where(l_i > 0.0, scale_out, 0.0)[:, None]
        out_dt = orow.dtype.element_ty
        tl.store(orow + offs_d[None, :], (acc * scale_out).to(out_dt),
                 mask=rmask_rows[:, None] & (offs_d[None, :] < NOPE))
        om = rmask_rows[:, None] & rmask[None, :]
        tl.store(orow + NOPE + 2 * offs_r[None, :], (ar_e * scale_out).to(out_dt), mask=om)
        tl.store(orow + NOPE + 2 * offs_r[None, :] + 1, (ar_o * scale_out).to(out_dt), mask=om)

    @triton.jit
    def _query_rows(q_ptr, qpos_ptr, T, H, stride_qt, stride_qh, head0, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                    D: tl.constexpr, NOPE: tl.constexpr):
        """A program's ROWS consecutive query rows x BLOCK_H heads from head0 as one matrix (row m: query row
        m // BLOCK_H, head head0 + m % BLOCK_H): each matrix row's query row within the program, the first query row,
        its head, whether it is real, its query row (rows past the end read row T-1 and never attend), its query
        pointer, its query with the rope channels zeroed, and its request position."""
        offs_m = tl.arange(0, ROWS * BLOCK_H)
        rid = offs_m // BLOCK_H
        t0 = tl.program_id(0).to(tl.int64) * ROWS
        t_raw = t0 + rid
        hh = head0 + offs_m % BLOCK_H
        mmask = (t_raw < T) & (hh < H)
        t = tl.minimum(t_raw, T - 1)
        qrow = q_ptr + t[:, None] * stride_qt + hh[:, None] * stride_qh
        offs_d = tl.arange(0, D)
        qn = tl.load(qrow + offs_d[None, :], mask=mmask[:, None] & (offs_d[None, :] < NOPE), other=0.0)
        return rid, t0, hh, mmask, t, qrow, qn, tl.load(qpos_ptr + t)
