"""`_multiseg_keyframe_kernel`: the fused multi-segment attention with the relocation turned onto the keys
(runtime/kernels/multiseg.py's docstring and `multi_segment_attention`, which launches it with `key_frame=True`):
the query turned once to its own position, each key tile's rope pairs turned in registers by +Delta of the segment
each key lies in (a row of the per-segment turn table), every segment a row reaches in one loop of key tiles."""
from __future__ import annotations

from ._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from ._triton import online_step, table_ptr
    from .multiseg_tiles import _finish, _query_rows, _segment_range, _start, _turn_query

    @triton.jit
    def _locate(tab_ptr, P, key, kmin, kmax, BY_ENTRY: tl.constexpr, COLS: tl.constexpr, PB: tl.constexpr):
        """Keys [N] -> where each lies (the key-frame kernel): a request position (window keys) or a global entry id
        (BY_ENTRY) falls in the last segment whose start (Delta, or its first entry id) is <= the key; segments
        come in increasing order. Returns per key that segment's latent or entries address (int64), the key's row
        in it, the segment's row count (n or its entry count), its Delta and its index in the table. Every key the
        caller reads lies in kmin..kmax, so only the segments from kmin's to kmax's are walked (found by one count
        over the table's starts: one or two for a tile of a 64-document request, not all 66)."""
        addr = key * 0
        first = key * 0
        bound = key * 0
        dlt = key * 0
        seg = key * 0
        j0, j1 = _segment_range(tab_ptr, P, 5 if BY_ENTRY else 2, kmin, kmax, COLS, PB)
        for j in range(j0, j1):
            row = tab_ptr + j * COLS
            d_j = tl.load(row + 2)
            if BY_ENTRY:
                s_j = tl.load(row + 5)
                a_j = tl.load(row + 3)
                b_j = tl.load(row + 4)
            else:
                s_j = d_j
                a_j = tl.load(row)
                b_j = tl.load(row + 1)
            inside = key >= s_j
            addr = tl.where(inside, a_j, addr)
            first = tl.where(inside, s_j, first)
            bound = tl.where(inside, b_j, bound)
            dlt = tl.where(inside, d_j, dlt)
            seg = tl.where(inside, j, seg)
        return addr, key - first, bound, dlt, seg

    @triton.jit
    def _key_tile(qn, qre, qro, addr, local, seg, ok, svalid, turn_ptr, offs_d, offs_r, rmask, m_i, l_i, acc, ar_e,
                  ar_o, qk_scale, D: tl.constexpr, NOPE: tl.constexpr, HALF_R: tl.constexpr, PREC: tl.constexpr,
                  dt: tl.constexpr):
        """One tile of keys from any segments (the key-frame kernel): each key row read in place at its own
        segment's address, its rope pairs turned by +Delta of that segment in registers (into the request frame,
        where the query is turned once), scored and summed with one online softmax. K = V: the turned rope pairs
        also feed the request-frame rope value sums ar_*; the non-rope value sum is acc's. ok [N]: keys to read;
        seg [N] each key's segment, whose row of the turn table (cos, then sin, of Delta x the frequencies) turns
        it: read, not computed (a cos and a sin per pair and key cost more than the tile's softmax, and past an
        angle of about 1e5 radians, which Delta reaches at 128K, the library's exact argument reduction takes its
        slow path); svalid [M, N] (or [1, N]): which query row attends which of them."""
        ptr = table_ptr(tl.where(ok, addr, 0), dt) + tl.where(ok, local, 0) * D
        k = tl.load(ptr[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        rp = ptr[:, None] + NOPE + 2 * offs_r[None, :]
        rm = ok[:, None] & rmask[None, :]
        ke = tl.load(rp, mask=rm, other=0.0).to(tl.float32)
        ko = tl.load(rp + 1, mask=rm, other=0.0).to(tl.float32)
        tp = turn_ptr + seg[:, None] * (2 * HALF_R) + offs_r[None, :]
        cs = tl.load(tp, mask=rm, other=1.0)
        sn = tl.load(tp + HALF_R, mask=rm, other=0.0)
        kre = (ke * cs - ko * sn).to(dt)
        kro = (ko * cs + ke * sn).to(dt)
        s = tl.dot(qn, tl.trans(k), input_precision=PREC)
        s = tl.dot(qre, tl.trans(kre), s, input_precision=PREC)
        s = tl.dot(qro, tl.trans(kro), s, input_precision=PREC) * qk_scale
        m_new, l_i, pk, alpha = online_step(s, svalid, m_i, l_i, dt)
        acc = acc * alpha[:, None] + tl.dot(pk, k, input_precision=PREC)       # rope channels unused
        ar_e = ar_e * alpha[:, None] + tl.dot(pk, kre, input_precision=PREC)
        ar_o = ar_o * alpha[:, None] + tl.dot(pk, kro, input_precision=PREC)
        return m_new, l_i, acc, ar_e, ar_o

    @triton.jit
    def _multiseg_keyframe_kernel(q_ptr, qpos_ptr, tab_ptr, picks_ptr, bounds_ptr, freq_ptr, sink_ptr, o_ptr,
                                  turn_ptr, T, H, P, window, ratio, n_picks, qk_scale, sink_scale, stride_qt, stride_qh,
                                  MODE: tl.constexpr, D: tl.constexpr, HALF_R: tl.constexpr, RP: tl.constexpr,
                                  COLS: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                                  BLOCK_N: tl.constexpr, PREC: tl.constexpr, PB: tl.constexpr):
        """`_multiseg_kernel`'s result with the relocation turned onto the keys: the query's rope pairs are turned
        once to t (the request frame) and every key tile's rope pairs by +Delta of the key's segment, in registers
        (the same scores: q(t - Delta) . k = q(t) . k(+Delta)); the rope value sums are then in the request frame
        and turned back once at t. A row's keys are then one loop of key tiles whatever the segments (window
        positions t-W+1..t, then the visible entries by global id or the row's picks), each key tile able to span
        segments, so the tile loads pipeline; `_multiseg_kernel` runs one short loop per segment (about one tile of
        a row's picks). The stored latent and entries are read in place, never rewritten. Segments must come in
        increasing position, each segment's entries numbered from its table row's first id (col 5).
        A program holds ROWS consecutive query rows x BLOCK_H heads (matrix row m = row m // BLOCK_H, head
        m % BLOCK_H), as `_multiseg_packed_kernel` does: with ROWS > 1 (calls of few heads) the rows share their
        window tiles (over the union of their windows) and entry tiles (up to the furthest row's visible entries),
        each score masked to the rows that see it; picks are walked row by row (a second loop). One loop, not one
        per kind of key, keeps one copy of the tile's work: `ptxas -v` (tests/kernels/compile_sm90.py) counts
        0.6 KB of spill stores per thread at 64 heads, against 1.8-2.1 KB with a loop per kind (0.3 KB with a walk of
        the whole table per tile instead of `_locate`'s span, which measured slower: 2.87 ms against 2.58 for the
        active rows' HCA call at 32K and 32 documents, one H100)."""
        NOPE: tl.constexpr = D - 2 * HALF_R
        M: tl.constexpr = ROWS * BLOCK_H
        rid, t0, hh, mmask, t, qrow, qn, pos = _query_rows(q_ptr, qpos_ptr, T, H, stride_qt, stride_qh,
                                                           tl.program_id(1) * BLOCK_H, ROWS, BLOCK_H, D, NOPE)
        offs_d = tl.arange(0, D)
        offs_r = tl.arange(0, RP)
        rmask = offs_r < HALF_R
        offs_n = tl.arange(0, BLOCK_N)
        dt = q_ptr.dtype.element_ty
        freq = tl.load(freq_ptr + offs_r, mask=rmask, other=0.0)[None, :]
        qre, qro, cs, sn = _turn_query(qrow, pos.to(tl.float32)[:, None], freq, mmask[:, None] & rmask[None, :],
                                       offs_r, NOPE, dt)
        m_i, l_i, acc, ar_e, ar_o = _start(M, D, RP)
        pos_lo = tl.min(tl.where(mmask, pos, pos + window), 0)
        pos_hi = tl.max(tl.where(mmask, pos, -1), 0)
        w_lo = tl.maximum(pos_lo - window + 1, 0)          # window: request positions w_lo..pos_hi
        n_win = tl.cdiv(pos_hi + 1 - w_lo, BLOCK_N)
        # then the entries complete before each row's t - Delta (numbered globally), or a lone row's picks
        g_end = pos_hi * 0
        if MODE == 1:
            for j in range(P):
                row = tab_ptr + j * COLS
                nv = tl.minimum(tl.maximum(pos_hi - tl.load(row + 2) + 1, 0) // ratio, tl.load(row + 4))
                g_end = tl.where(nv > 0, tl.load(row + 5) + nv, g_end)
        if MODE == 2 and ROWS == 1:
            g_end = tl.load(bounds_ptr + t0 * (P + 1) + P).to(tl.int64)
        # one loop over both kinds of key tile: one copy of the tile's work, whose state (the [rows, D] float32
        # accumulator and the tile) then fits the registers with far fewer spills than a loop per kind
        for i in range(0, n_win + tl.cdiv(g_end, BLOCK_N)):
            if i < n_win:
                k0 = w_lo + i * BLOCK_N
                key = k0 + offs_n
                addr, local, bound, dlt, seg = _locate(tab_ptr, P, key, k0, tl.minimum(k0 + BLOCK_N - 1, pos_hi),
                                                       False, COLS, PB)
                ok = (key <= pos_hi) & (local >= 0) & (local < bound)
                sv = ok[None, :] & (key[None, :] <= pos[:, None]) & (key[None, :] > pos[:, None] - window)
            else:
                k = (i - n_win) * BLOCK_N + offs_n
                if MODE == 2:      # the row's picks: global entry ids, sorted, bounds[t, P] of them real
                    gid = tl.load(picks_ptr + t0 * n_picks + k, mask=k < g_end, other=0).to(tl.int64)
                    g_lo = tl.min(tl.where(k < g_end, gid, 1 << 62), 0)
                    g_hi = tl.max(tl.where(k < g_end, gid, -1), 0)
                else:
                    gid = k.to(tl.int64)
                    g_lo = (i - n_win) * BLOCK_N
                    g_hi = tl.minimum(g_lo + BLOCK_N, g_end) - 1
                addr, local, bound, dlt, seg = _locate(tab_ptr, P, gid, g_lo, g_hi, True, COLS, PB)
                ok = (k < g_end) & (local >= 0) & (local < bound)
                if MODE == 1:      # entry w of a segment at Delta is complete from position Delta + (w + 1) ratio - 1
                    sv = ok[None, :] & (dlt + (local + 1) * ratio - 1 <= pos[:, None])
                else:
                    sv = ok[None, :] & (pos[:, None] >= 0)
            sv = sv & mmask[:, None]
            if ROWS == 1:          # one row: every tile is its own
                m_i, l_i, acc, ar_e, ar_o = _key_tile(qn, qre, qro, addr, local, seg, ok, sv, turn_ptr, offs_d,
                                                      offs_r, rmask, m_i, l_i, acc, ar_e, ar_o, qk_scale, D, NOPE,
                                                      HALF_R, PREC, dt)
            else:
                if tl.max(sv.to(tl.int32)) > 0:            # windows far apart: tiles between them are skipped
                    m_i, l_i, acc, ar_e, ar_o = _key_tile(qn, qre, qro, addr, local, seg, ok, sv, turn_ptr,
                                                          offs_d, offs_r, rmask, m_i, l_i, acc, ar_e, ar_o, qk_scale,
                                                          D, NOPE, HALF_R, PREC, dt)
        if MODE == 2 and ROWS > 1:     # several rows: each row's picks walked on its own, the others masked out
            for r in range(ROWS):
                tr = t0 + r
                if tr < T:
                    cnt = tl.load(bounds_ptr + tr * (P + 1) + P).to(tl.int64)
                    mine = mmask & (rid == r)
                    for start in range(0, cnt, BLOCK_N):
                        k = start + offs_n
                        gid = tl.load(picks_ptr + tr * n_picks + k, mask=k < cnt, other=0).to(tl.int64)
                        g_lo = tl.min(tl.where(k < cnt, gid, 1 << 62), 0)
                        g_hi = tl.max(tl.where(k < cnt, gid, -1), 0)
                        addr, local, bound, dlt, seg = _locate(tab_ptr, P, gid, g_lo, g_hi, True, COLS, PB)
                        ok = (k < cnt) & (local >= 0) & (local < bound)
                        m_i, l_i, acc, ar_e, ar_o = _key_tile(qn, qre, qro, addr, local, seg, ok,
                                                              mine[:, None] & ok[None, :], turn_ptr, offs_d, offs_r,
                                                              rmask, m_i, l_i, acc, ar_e, ar_o, qk_scale, D, NOPE,
                                                              HALF_R, PREC, dt)
        # the request-frame rope value sums turned back at t (the conjugate rotation)
        oe = ar_e * cs + ar_o * sn
        oo = ar_o * cs - ar_e * sn
        sink = tl.load(sink_ptr + hh, mask=hh < H, other=0.0).to(tl.float32) * sink_scale
        _finish(o_ptr + t[:, None] * (H * D) + hh[:, None] * D, mmask, m_i, l_i, acc, oe, oo, sink, offs_d, offs_r,
                rmask, NOPE)
