"""Segment attention: a query row's attention over every relocated segment it reaches, in one frame per segment,
merged by log-sum-exp with the sink once. Per segment only the 64 RoPE channels are turned (query in, partial output
out, the output's inverse RoPE folded into the same rotation), each part lands in one stacked buffer and every row
is merged once; on CUDA calls of many heads take the fused multi-segment kernel instead (one launch).

One code path on every device; only the leaves switch (`runtime.kernels.enabled`): Triton kernels on CUDA, their
torch references elsewhere."""
from __future__ import annotations

import numpy as np
import torch

from runtime.model.config import CSA, HCA, WINDOW
from runtime.model.deepseek_v4 import NEG_INF
from runtime.policy import DEFAULT_POLICY, RuntimePolicy
from runtime.kernels import enabled, merge_stacked, rope_
from runtime.kernels._host import to_device_nowait
from runtime.kernels.multiseg import multi_segment_attention, segment_table
from runtime.kernels.reference import sparse_mqa_reference
from runtime.kernels.sparse_attention import packed_rows, sparse_mqa_parts
from .keys import SegmentKeys, angles, delta_turns, memo, offsets, shifted
from .picks import global_from_split, indexer_global_picks, local_picks, own_global_picks, part_runs, pick_runs


def _plan(attn, host, segments, by, trig=None):
    """Which rows each segment serves (rows come in increasing position, so a contiguous range found on the
    host): its window rows reach queries up to W-1 rows past its end; its entries every later query (HCA, or
    CSA picks over the union of segments, `by` "union"); own picks (`by` "own") only the segment's own rows (the
    rows past its end that its window still reaches attend its window only: their picks lie in their own
    segment). -> [(j, lo, hi, mode)]. The ranges depend only on the rows and the segments' places and sizes, so
    they are found once per call's rows (`trig`) for every layer of a kind."""
    shapes = tuple((s.delta, s.latent.shape[0], 0 if s.entries is None else s.entries.shape[0]) for s in segments)
    return memo(trig, ("plan", attn.kind, attn.cfg.window_size, by, shapes),
                lambda: _ranges(attn.kind, attn.cfg.window_size, host, shapes, by))


def _ranges(kind, W, host, shapes, by):
    """`_plan`'s ranges [(j, lo, hi, mode)] from the rows' positions and each segment's (Delta, n, entries)."""
    T = host.shape[0]
    ranges = []
    for j, (delta, n, n_ent) in enumerate(shapes):
        lo = int(np.searchsorted(host, delta))
        win_hi = int(np.searchsorted(host, delta + n + W - 1))
        mode, hi = "none", win_hi
        if kind == HCA and n_ent:
            mode, hi = "causal", T
        elif kind == CSA and n_ent and by == "own":
            if int(np.searchsorted(host, delta + n)) > lo:
                mode = "picks"
        elif kind == CSA and n_ent and by == "union":
            mode, hi = "picks", T
        if hi > lo:
            ranges.append((j, lo, hi, mode))
    return ranges


def hca_key_frame(n_segments: int, policy: RuntimePolicy) -> bool:
    """An HCA call over this many segments runs fused in the key frame (`policy.key_frame_min_segments_hca`)."""
    return 0 < policy.key_frame_min_segments_hca <= n_segments


def fused_call(q_raw: torch.Tensor, picks, n_segments: int, policy: RuntimePolicy, kind=None) -> bool:
    """A call `segment_attention` makes in one launch of the fused multi-segment kernel (CUDA, no caller's picks,
    at least `policy.fused_min_heads` heads, or `policy.fused_min_segments` segments, or for an HCA layer (`kind`)
    the key frame's `policy.key_frame_min_segments_hca`); the others hold one stacked part per segment."""
    return enabled(q_raw) and picks is None and (q_raw.shape[1] >= policy.fused_min_heads or
                                                 n_segments >= policy.fused_min_segments or
                                                 (kind == HCA and hca_key_frame(n_segments, policy)))


def segment_attention(attn, q_raw: torch.Tensor, qpos: torch.Tensor, segments: list[SegmentKeys], sink: torch.Tensor,
                      idx_inputs=None, picks: list | None = None, qpos_host: np.ndarray | None = None,
                      own_picks: torch.Tensor | None = None, trig: dict | None = None,
                      out: torch.Tensor | None = None,
                      policy: RuntimePolicy = DEFAULT_POLICY) -> tuple[torch.Tensor, torch.Tensor | int]:
    """q_raw [T,H,D] normed, not yet roped; qpos request positions (increasing). Returns the merged per-head output
    [T,H,D] in q_raw's dtype WITH the inverse output RoPE applied (ready for W_a), and the number of (query, key)
    pairs attended (an int from host arithmetic, or a tensor where picks are counted: no host sync).

    Per segment j at Delta_j, only on the rows it serves: the query's RoPE channels are rotated to t - Delta_j, the
    sparse attention writes the partial output and LSE into slice j of one stacked buffer, and the partial output's
    RoPE channels are de-rotated at t - Delta_j (+Delta_j into the request frame, then the inverse output RoPE at t,
    in one rotation); on CUDA every part in a bounded number of launches (`_stacked_parts`), elsewhere one torch
    reference call per part. One pass then merges every row's parts with the sink once. `own_picks` [T, k]: each
    row's entry picks in its own segment (the artifact's, global_picks="artifact"); else CSA picks are the native
    indexer's top-k over the union of all segments' visible entries. On CUDA, a call of at least
    `policy.fused_min_heads` heads or `policy.fused_min_segments` segments (HCA: `key_frame_min_segments_hca`) does
    all of this in one launch of the fused multi-segment kernel instead (`_fused_segment_attention`).
    `out`: a contiguous [T,H,D] tensor of q_raw's dtype the merged output is written into (a caller's row slice),
    else a new one."""
    T, H, D = q_raw.shape
    W = attn.cfg.window_size
    host = qpos.cpu().numpy() if qpos_host is None else qpos_host      # host arithmetic: numpy, never a launch
    if fused_call(q_raw, picks, len(segments), policy, attn.kind):
        return _fused_segment_attention(attn, q_raw, qpos, segments, sink, idx_inputs, host, own_picks, trig, out,
                                        policy)
    # CSA picks as one [T, k] tensor of global entry ids (segment j's entry w = first[j] + w, `total` = none):
    # each row's own document's, the native indexer's over the union, or a caller's per-segment lists joined
    gp = by = first = total = None
    if attn.kind == CSA:
        if own_picks is not None:
            first, total = offsets(segments, "entries")
            by, gp = "own", own_global_picks(segments, qpos, own_picks, first, total, trig)
        elif picks is not None:
            first, total = offsets(segments, "entries")
            if any(pk is not None for pk in picks):
                by, gp = "union", global_from_split(picks, first, total, segments)
        else:
            first, total = offsets(segments, "index_keys")
            if total:
                by, gp = "union", indexer_global_picks(attn, qpos, segments, idx_inputs, first, total, trig)
    plan = _plan(attn, host, segments, by, trig)
    o_buf = torch.empty((len(plan), T, H, D), dtype=torch.float32, device=q_raw.device)
    lse_buf = torch.full((len(plan), T, H), NEG_INF, dtype=torch.float32, device=q_raw.device)
    if enabled(q_raw):
        _stacked_parts(attn, q_raw, qpos, host, segments, plan, o_buf, lse_buf, trig, gp, first, by == "union")
    else:
        for p, (j, lo, hi, mode) in enumerate(plan):
            seg = segments[j]
            cos, sin = angles(attn, qpos, lo, hi, seg.delta, trig)
            qs = rope_(q_raw[lo:hi].clone(), cos, sin)
            pk = local_picks(gp[lo:hi], first[j], seg.entries.shape[0]) if mode == "picks" else None
            ro, rl = sparse_mqa_reference(qs, seg.latent, shifted(qpos, lo, hi, seg.delta, trig), W,
                                          seg.entries if mode != "none" else None, mode, attn.ratio or 1, pk,
                                          attn.scale)
            o_buf[p, lo:hi] = rope_(ro, cos, sin, inverse=True)
            lse_buf[p, lo:hi] = rl
    out = merge_stacked(o_buf, lse_buf, sink, q_raw.dtype, [(lo, hi) for _, lo, hi, _ in plan], out=out)
    # pairs the kernel attends: clipped window rows plus visible entries (on the host), plus picks (on the device)
    pairs = _pairs_host(attn, host, segments, attn.kind == HCA, trig)
    if any(m == "picks" for _, _, _, m in plan):
        pairs = (gp < total).sum() + pairs
    return out, pairs


def _stacked_parts(attn, q_raw, qpos, host, segments, plan, o_buf, lse_buf, trig, gp=None, first=None,
                   union=False):
    """The stacked parts on CUDA in a bounded number of launches whatever the segments: one launch of the sparse
    kernel over every window/causal part and one over every picks part (`sparse_mqa_parts`: each program reads its
    part's segment from a table and turns its query rows to t - Delta as it loads them), then one rotation that
    turns every part's served output rows back (`rope_` over listed rows). The tables that depend only on the rows
    and the segments' places (angles, programs, output rows) are made once per call's rows (`trig`). gp [T, k]:
    the rows' picks as global entry ids numbered by `first` (every picks part reads its rows' lists in place and
    takes its own segment's ids). `union`: a row's picks spread over every segment, so with more than one picks
    part the rows are sorted once and each part reads only its segment's run (`part_runs`), not all k slots;
    own picks (one segment's ids a row) are read as they are."""
    if not plan:
        return
    T, H, D = q_raw.shape
    dev = q_raw.device
    spans = tuple((lo, hi, segments[j].delta) for j, lo, hi, _ in plan)
    rows = packed_rows(H, "causal")

    def tables():
        n = np.array([hi - lo for lo, hi, _ in spans], dtype=np.int64)
        v0 = np.concatenate([[0], np.cumsum(n)[:-1]])
        t = np.concatenate([np.arange(lo, hi) for lo, hi, _ in spans])
        delta = np.repeat(np.array([d for _, _, d in spans], dtype=np.int64), n)
        part = np.repeat(np.arange(len(spans), dtype=np.int64), n)
        cos, sin = attn.rotary.cos_sin(to_device_nowait(torch.from_numpy(host[t] - delta), dev))
        out_rows = to_device_nowait(torch.from_numpy(part * T + t), dev)
        progs = {}
        for mode, step in (("causal", rows), ("picks", 1)):
            want = [p for p, (_, _, _, m) in enumerate(plan) if (m == "picks") == (mode == "picks")]
            # per program: its part, first row, that row's angle row, the part's end
            firsts = [np.arange(spans[p][0], spans[p][1], step, dtype=np.int64) for p in want]
            prog = np.zeros((sum(f.size for f in firsts), 4), dtype=np.int64)
            if want:
                prog[:, 0] = np.repeat(want, [f.size for f in firsts])
                prog[:, 1] = np.concatenate(firsts)
                lo_of = np.array([spans[p][0] for p in want], dtype=np.int64)
                prog[:, 2] = prog[:, 1] + np.repeat(v0[want] - lo_of, [f.size for f in firsts])
                prog[:, 3] = np.repeat([spans[p][1] for p in want], [f.size for f in firsts])
            progs[mode] = (want, to_device_nowait(torch.from_numpy(prog), dev))
        return cos, sin, out_rows, progs
    cos, sin, out_rows, progs = memo(trig, ("parts", attn.kind == WINDOW, T, rows, spans,
                                            tuple(m == "picks" for _, _, _, m in plan)), tables)
    # every part's segment as a table row; the window-only parts' entries left out
    tab, keep = segment_table([SegmentKeys(segments[j].delta, segments[j].latent,
                                           segments[j].entries if mode != "none" else None)
                               for j, _, _, mode in plan], dev, q_raw.dtype, True,
                              [first[j] if first is not None else 0 for j, _, _, _ in plan])
    runs = None
    if union and len(progs["picks"][0]) > 1:
        gp, runs = part_runs(gp, [(first[j], segments[j].entries.shape[0]) if m == "picks" else (0, 0)
                                  for j, _, _, m in plan], trig)
    for mode, (want, prog) in progs.items():
        if want:
            sparse_mqa_parts(q_raw, qpos, tab, prog, cos, sin, o_buf, lse_buf, attn.cfg.window_size,
                             attn.ratio or 1, attn.scale, mode, gp if mode == "picks" else None,
                             rows if mode == "causal" else 1, runs=runs if mode == "picks" else None)
    del keep
    rope_(o_buf.view(-1, H, D), cos, sin, inverse=True, rows=out_rows)


def _pairs_host(attn, host: np.ndarray, segments: list[SegmentKeys], causal: bool, trig=None) -> int:
    """(query, key) pairs of the window parts, and of the entry parts in "causal" mode, counted on the host; once
    per call's rows and segment shapes (`trig`): every layer of a kind attends the same pairs."""
    shapes = tuple((s.delta, s.latent.shape[0], -1 if not causal or s.entries is None else s.entries.shape[0])
                   for s in segments)
    return memo(trig, ("pairs", attn.cfg.window_size, attn.ratio if causal else 0, shapes),
                 lambda: _count_pairs(attn, host, segments, causal))


def _count_pairs(attn, host: np.ndarray, segments: list[SegmentKeys], causal: bool) -> int:
    W, pairs = attn.cfg.window_size, 0
    for seg in segments:
        n = seg.latent.shape[0]
        ch = host - seg.delta
        pairs += int((np.minimum(ch, n - 1) - np.maximum(ch - W + 1, 0) + 1).clip(min=0).sum())
        if causal and seg.entries is not None:
            pairs += int(np.minimum(np.maximum(ch + 1, 0) // attn.ratio, seg.entries.shape[0]).sum())
    return pairs


def _fused_segment_attention(attn, q_raw, qpos, segments, sink, idx_inputs, host, own_picks, trig, out=None,
                             policy: RuntimePolicy = DEFAULT_POLICY):
    """`segment_attention` on CUDA for calls of at least `policy.fused_min_heads` heads or
    `policy.fused_min_segments` segments (`fused_call`): one launch of the fused multi-segment kernel
    (runtime/kernels/multiseg.py) over every segment each row reaches; no per-segment part goes through HBM. CSA picks (the native indexer's top-k over the union of all segments, or each row's own
    document's offline picks) go to it as one sorted list of global entry ids per row."""
    mode = {HCA: "causal", CSA: "picks"}.get(attn.kind, "none")
    if mode != "none" and all(s.entries is None or s.entries.shape[0] == 0 for s in segments):
        mode = "none"
    gp = first = total = None
    if mode == "picks":
        first, total = offsets(segments, "index_keys" if own_picks is None else "entries")
        gp = own_global_picks(segments, qpos, own_picks, first, total, trig) if own_picks is not None else \
            indexer_global_picks(attn, qpos, segments, idx_inputs, first, total, trig)
    return fused_attention(attn, q_raw, qpos, segments, sink, host, mode, gp, first, total, out=out, trig=trig,
                           policy=policy)


def fused_attention(attn, q_raw, qpos, segments, sink, host, mode: str, gp=None, first=None, total=None,
                    config: dict | None = None, out: torch.Tensor | None = None, trig: dict | None = None,
                    policy: RuntimePolicy = DEFAULT_POLICY):
    """One launch of the fused multi-segment kernel in `mode` ("none", "causal", or "picks" with gp [T, k] global
    entry ids, `total` for an empty slot, numbered by `first` as `offsets` does), and the (query, key) pairs it
    attends; "picks" calls of at least `policy.key_frame_min_heads` heads in the key frame, and "causal" ones over at
    least `policy.key_frame_min_segments_hca` segments (when set). `config`: the kernel's
    block sizes (bench/multiseg.py sweeps them); `out`: where the output goes."""
    bounds, pairs = None, 0
    if mode == "picks" and gp.shape[1] == 0:     # no slot to pick from: the windows only
        mode, gp, first = "none", None, None
    if mode == "picks":
        gp, bounds = pick_runs(gp, first, total, trig)
        pairs = bounds[:, -1].sum()
    key_frame = (mode == "picks" and q_raw.shape[1] >= policy.key_frame_min_heads) or \
        (mode == "causal" and hca_key_frame(len(segments), policy))
    turns = delta_turns(attn, tuple(s.delta for s in segments), q_raw.device, trig) if key_frame else None
    out = multi_segment_attention(q_raw, qpos, segments, sink, attn.cfg.window_size, mode, attn.ratio or 1,
                                  attn.scale, attn.rotary.inv_freq, gp, first, bounds, config=config, out=out,
                                  key_frame=key_frame, turns=turns)
    return out, pairs + _pairs_host(attn, host, segments, mode == "causal", trig)

