"""Online reuse path: one request = [doc 1 (prefix, Delta=0), doc 2..k (relocated), new rows (question, then
decoded tokens)]. See docs/reuse.md for what is cached, what is recomputed and how rows are chosen.

- The prefix document's state is its artifact in every layer (exact: causal attention never looks ahead).
- Fence layers run the native model over every non-prefix row, continuing from the prefix artifact's cache.
- Reusable layers: active rows run in full (all heads, latent recomputed into an overlay, MoE with adaptive
  fanout); other relocated rows restore W_a,L O_L from the artifact, compute the Global heads online, skip the
  FFN. Attention relocates each segment by rotating the query to t - Delta and the partial output by +Delta, and
  merges segments by log-sum-exp with the sink once. Artifacts are never rewritten or concatenated.

One code path on every device; only the leaves switch (`runtime.kernels.enabled`): Triton kernels on CUDA, their
torch references elsewhere. Per segment only the 64 RoPE channels are turned (query in, partial output out, the
output's inverse RoPE folded into the same rotation), each part lands in one stacked buffer and every row is merged
once. Everything that depends only on the request's rows (active/other split, per-document row ids, the blocks to
re-pool, RoPE angles) is built once per request, so a reusable layer makes no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields as dataclass_fields

import numpy as np
import torch

from runtime.model.config import CSA, HCA, WINDOW
from runtime.model.deepseek_v4 import (NEG_INF, Block, CompressorState, LayerCache, Rotary, Transformer,
                                       grouped_projection, phase, prefill_out_rows, share_positions, shared_angles,
                                       shared_arange, unweighted_rms_norm)
from runtime.policy import DEFAULT_POLICY, RuntimePolicy
from runtime.kernels import enabled, merge_stacked, rope_, sparse_mqa_attention
from runtime.kernels._host import to_device_nowait
from runtime.kernels.f32linear import kept_on_weights
from runtime.kernels.fp8_rows import gather_dequant_rows
from runtime.kernels.multiseg import multi_segment_attention
from runtime.kernels.rope import rope_source
from runtime.kernels.reference import sparse_mqa_reference
from .artifact import DocumentArtifact, LayerArtifact, is_private
from .controller import choose_active
from .ledger import Ledger
from .profile import ReuseProfile
from .roles import global_mask


# ============================================================================ segment attention

@dataclass
class SegmentKeys:
    """One segment's keys in one layer, in its canonical frame (positions 0..n-1)."""
    delta: int
    latent: torch.Tensor                      # [n, D]
    entries: torch.Tensor | None = None       # [N, D]
    index_keys: torch.Tensor | None = None    # [N, id]


def _memo(trig, key, make):
    """`make()` once per key for all the request's layers: `trig` is the rows' per-request cache (None: none)."""
    if trig is None:
        return make()
    if key not in trig:
        trig[key] = make()
    return trig[key]


def _shifted(qpos, lo, hi, delta, trig):
    """Rows lo..hi's positions in a segment's frame (t - Delta)."""
    return _memo(trig, ("pos", lo, hi, delta), lambda: qpos[lo:hi] - delta)


def _angles(attn, qpos, lo, hi, delta, trig):
    """cos/sin at t - delta for rows lo..hi. Every non-window layer has the same rotary (YaRN, compress theta) and
    every window layer the same plain one (Attention.__init__), so one cache per call's rows serves all layers."""
    return _memo(trig, (attn.kind == WINDOW, lo, hi, delta),
                 lambda: attn.rotary.cos_sin(_shifted(qpos, lo, hi, delta, trig)))


def _plan(attn, host, segments, picks, own_picks, trig=None):
    """Which rows each segment serves (rows come in increasing position, so a contiguous range found on the
    host): its window rows reach queries up to W-1 rows past its end; its entries every later query (HCA, or
    CSA picks over the union of segments); own picks only the segment's own rows. -> [(j, lo, hi, mode, picks)]

    With own picks, every segment's picks (its own rows' picks, then -1 for the rows past its end) come out of one
    gather from own_picks with a -1 row appended; the gather's row ids are built once per call's rows (`trig`)."""
    T, W = host.shape[0], attn.cfg.window_size
    plan, own = [], []
    for j, seg in enumerate(segments):
        n = seg.latent.shape[0]
        lo = int(np.searchsorted(host, seg.delta))
        win_hi = int(np.searchsorted(host, seg.delta + n + W - 1))
        n_ent = 0 if seg.entries is None else seg.entries.shape[0]
        mode, hi, pk = "none", win_hi, None
        if attn.kind == HCA and n_ent:
            mode, hi = "causal", T
        elif attn.kind == CSA and n_ent and own_picks is not None:
            own_hi = int(np.searchsorted(host, seg.delta + n))
            if own_hi > lo:      # rows past the segment's end (the next one's first W-1) see its window only
                own.append((len(plan), lo, own_hi, win_hi))
                mode = "picks"
        elif attn.kind == CSA and n_ent and picks is not None and picks[j] is not None:
            mode, hi, pk = "picks", T, picks[j][lo:]
        if hi > lo:
            plan.append((j, lo, hi, mode, pk))
    if own:
        rows = _memo(trig, ("own_rows", tuple(own)), lambda: torch.tensor(
            [r for _, lo, own_hi, win_hi in own for r in [*range(lo, own_hi), *[len(own_picks)] * (win_hi - own_hi)]],
            dtype=torch.long, device=own_picks.device))
        every = torch.cat([own_picks, own_picks.new_full((1, own_picks.shape[1]), -1)]).index_select(0, rows)
        off = 0
        for p, lo, _, win_hi in own:
            j, _, hi, mode, _ = plan[p]
            plan[p] = (j, lo, hi, mode, every[off:off + win_hi - lo])
            off += win_hi - lo
    return plan


def segment_attention(attn, q_raw: torch.Tensor, qpos: torch.Tensor, segments: list[SegmentKeys], sink: torch.Tensor,
                      idx_inputs=None, picks: list | None = None, qpos_host: np.ndarray | None = None,
                      own_picks: torch.Tensor | None = None, trig: dict | None = None,
                      out: torch.Tensor | None = None, q_scratch: bool = False,
                      policy: RuntimePolicy = DEFAULT_POLICY) -> tuple[torch.Tensor, torch.Tensor | int]:
    """q_raw [T,H,D] normed, not yet roped; qpos request positions (increasing). Returns the merged per-head output
    [T,H,D] in q_raw's dtype WITH the inverse output RoPE applied (ready for W_a), and the number of (query, key)
    pairs attended (an int from host arithmetic, or a tensor where picks are counted: no host sync).

    Per segment j at Delta_j, only on the rows it serves: the query's RoPE channels are rotated to t - Delta_j (a
    64-channel write into one shared copy of q), the fused sparse attention (or its torch reference) writes the
    partial output and LSE into slice j of one stacked buffer, and the partial output's RoPE channels are
    de-rotated at t - Delta_j (+Delta_j into the request frame, then the inverse output RoPE at t, in one
    rotation). One pass then merges every row's parts with the sink once. `own_picks` [T, k]: each row's entry
    picks in its own segment (the artifact's, global_picks="artifact"); else CSA picks are the native indexer's
    top-k over the union of all segments' visible entries. On CUDA, a call of at least `policy.fused_min_heads`
    heads does all of this in one launch of the fused multi-segment kernel instead (`_fused_segment_attention`).
    `out`: a contiguous [T,H,D] tensor of q_raw's dtype the merged output is written into (a caller's row slice), else a new one.
    `q_scratch`: the caller no longer needs q_raw, so the per-segment rotations are written into it in place (from
    a compact copy of its rope channels, `rope_source`) instead of into a clone of it."""
    T, H, D = q_raw.shape
    W = attn.cfg.window_size
    host = qpos.cpu().numpy() if qpos_host is None else qpos_host      # host arithmetic: numpy, never a launch
    if enabled(q_raw) and picks is None and H >= policy.fused_min_heads:
        return _fused_segment_attention(attn, q_raw, qpos, segments, sink, idx_inputs, host, own_picks, trig, out,
                                        policy)
    n_picks = None                       # the number of picks attended, where the indexer counted it
    if attn.kind == CSA and picks is None and own_picks is None:
        picks, n_picks = _indexer_picks(attn, qpos, segments, idx_inputs, trig)
    plan = _plan(attn, host, segments, picks, own_picks, trig)
    o_buf = torch.empty((len(plan), T, H, D), dtype=torch.float32, device=q_raw.device)
    lse_buf = torch.full((len(plan), T, H), NEG_INF, dtype=torch.float32, device=q_raw.device)
    fast = enabled(q_raw)
    if q_scratch and fast and T:          # q_raw's rope channels saved (1/8 of it), the parts turned in q_raw itself
        src_all, q = rope_source(q_raw, 2 * attn.rotary.inv_freq.numel()), q_raw
    else:
        src_all, q = q_raw, q_raw.clone()  # the 448 non-RoPE channels are shared by every part
    # where the parts cover most of the stacked rows (HCA: every segment serves every later row), the outputs are
    # de-rotated in one launch over the whole stack (rows a part does not serve are never read by the merge)
    at_once = 2 * sum(hi - lo for _, lo, hi, _, _ in plan) >= len(plan) * T
    for p, (j, lo, hi, mode, pk) in enumerate(plan):
        seg = segments[j]
        cos, sin = _angles(attn, qpos, lo, hi, seg.delta, trig)
        qs = rope_(q[lo:hi], cos, sin, src=src_all[lo:hi])
        cl = _shifted(qpos, lo, hi, seg.delta, trig)
        ent = seg.entries if mode != "none" else None
        o, lse = o_buf[p, lo:hi], lse_buf[p, lo:hi]
        if fast:
            sparse_mqa_attention(qs, seg.latent, cl, W, ent, mode, attn.ratio or 1, pk, attn.scale, out=(o, lse))
        else:
            ro, rl = sparse_mqa_reference(qs, seg.latent, cl, W, ent, mode, attn.ratio or 1, pk, attn.scale)
            o.copy_(ro)
            lse.copy_(rl)
        if not at_once:
            rope_(o, cos, sin, inverse=True)
    if at_once and plan:
        cs = _memo(trig, ("stacked", attn.kind == WINDOW, T, tuple(segments[j].delta for j, *_ in plan)),
                   lambda: [torch.cat(c) for c in zip(*[_angles(attn, qpos, 0, T, segments[j].delta, trig)
                                                        for j, *_ in plan])])
        rope_(o_buf.view(len(plan) * T, H, D), *cs, inverse=True)
    out = merge_stacked(o_buf, lse_buf, sink, q_raw.dtype, [(lo, hi) for _, lo, hi, _, _ in plan], out=out)
    # pairs the kernel attends: clipped window rows plus visible entries (on the host), plus picks (on the device)
    pairs = _pairs_host(attn, host, segments, attn.kind == HCA, trig)
    if any(m == "picks" for _, _, _, m, _ in plan):
        if n_picks is None:              # own picks: one count; picks handed in by a caller: what each part attends
            n_picks = (own_picks >= 0).sum() if own_picks is not None else \
                sum((pk >= 0).sum() for _, _, _, m, pk in plan if m == "picks")
        pairs = n_picks + pairs
    return out, pairs


def _pairs_host(attn, host: np.ndarray, segments: list[SegmentKeys], causal: bool, trig=None) -> int:
    """(query, key) pairs of the window parts, and of the entry parts in "causal" mode, counted on the host; once
    per call's rows and segment shapes (`trig`): every layer of a kind attends the same pairs."""
    shapes = tuple((s.delta, s.latent.shape[0], -1 if not causal or s.entries is None else s.entries.shape[0])
                   for s in segments)
    return _memo(trig, ("pairs", attn.cfg.window_size, attn.ratio if causal else 0, shapes),
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
    """`segment_attention` on CUDA for calls of at least `policy.fused_min_heads` heads: one launch of the fused
    multi-segment kernel (runtime/kernels/multiseg.py) over every segment each row reaches; no per-segment part goes through HBM.
    CSA picks (the native indexer's top-k over the union of all segments, or each row's own document's offline
    picks) go to it as one sorted list of global entry ids per row."""
    mode = {HCA: "causal", CSA: "picks"}.get(attn.kind, "none")
    if mode != "none" and all(s.entries is None or s.entries.shape[0] == 0 for s in segments):
        mode = "none"
    gp = first = total = None
    if mode == "picks":
        first, total = _offsets(segments, "index_keys" if own_picks is None else "entries")
        gp = own_global_picks(segments, qpos, own_picks, first, total, trig) if own_picks is not None else \
            _indexer_global_picks(attn, qpos, segments, idx_inputs, first, total, trig)
    return fused_attention(attn, q_raw, qpos, segments, sink, host, mode, gp, first, total, out=out, trig=trig,
                           policy=policy)


def fused_attention(attn, q_raw, qpos, segments, sink, host, mode: str, gp=None, first=None, total=None,
                    config: dict | None = None, out: torch.Tensor | None = None, trig: dict | None = None,
                    policy: RuntimePolicy = DEFAULT_POLICY):
    """One launch of the fused multi-segment kernel in `mode` ("none", "causal", or "picks" with gp [T, k] global
    entry ids, `total` for an empty slot, numbered by `first` as `_offsets` does), and the (query, key) pairs it
    attends; "picks" calls of at least `policy.key_frame_min_heads` heads in the key frame. `config`: the kernel's
    block sizes (bench/multiseg.py sweeps them); `out`: where the output goes."""
    bounds, pairs = None, 0
    if mode == "picks" and gp.shape[1] == 0:     # no slot to pick from: the windows only
        mode, gp, first = "none", None, None
    if mode == "picks":
        gp, bounds = pick_runs(gp, first, total, trig)
        pairs = bounds[:, -1].sum()
    key_frame = mode == "picks" and q_raw.shape[1] >= policy.key_frame_min_heads
    out = multi_segment_attention(q_raw, qpos, segments, sink, attn.cfg.window_size, mode, attn.ratio or 1,
                                  attn.scale, attn.rotary.inv_freq, gp, first, bounds, config=config, out=out,
                                  key_frame=key_frame)
    return out, pairs + _pairs_host(attn, host, segments, mode == "causal", trig)


def own_global_picks(segments, qpos, own_picks, first, total, trig=None):
    """[T, k] each row's own-segment picks (local entry ids, -1 = none; the segment holding its position) as global
    ids numbered by `first` (`total` where a slot picked nothing). Each row's base id is built once per call's rows
    and layout (`trig`): its host->device copies would each wait for the stream."""
    def base():
        starts = torch.tensor([s.delta for s in segments], device=qpos.device)
        own = torch.searchsorted(starts, qpos, right=True) - 1
        return torch.tensor(first, device=qpos.device)[own][:, None]
    b = _memo(trig, ("own_base", tuple(s.delta for s in segments), tuple(first)), base)
    return torch.where(own_picks >= 0, own_picks.long() + b, total)


def pick_runs(gp, first, total, trig=None):
    """Global picks [T, k] -> (the same sorted ascending per row, bounds [T, P+1]: where each segment's run starts
    in the row's list; bounds[:, P] is the row's count of real picks). What the fused kernel walks. The segments'
    edges are copied to the device once per call's rows and layout (`trig`): the copy waits for the stream."""
    gp = gp.sort(dim=1).values.contiguous()
    edges = _memo(trig, ("edges", tuple(first), total, gp.shape[0]), lambda: torch.tensor(
        first + [total], device=gp.device).expand(gp.shape[0], -1).contiguous())
    return gp, torch.searchsorted(gp, edges)


def split_picks(gp, first, total):
    """Global picks [T, k] -> per segment its local entry ids [T, k] (-1 where the slot is another segment's or
    empty), in the slots' order. What the stacked path's per-segment parts take."""
    return [torch.where((gp >= f) & (gp < e), gp - f, -1) for f, e in zip(first, first[1:] + [total])]


def _indexer_global_picks(attn, qpos, segments, idx_inputs, first, total, trig=None):
    """Native lightning-indexer top-k over the union of every segment's visible entries (the indexer query rotated
    per segment) as global ids (segment j's entry w = first[j] + w; `total` where a slot picked nothing)."""
    h, qr = idx_inputs
    keyed = [(j, seg) for j, seg in enumerate(segments) if seg.index_keys is not None and seg.index_keys.shape[0]]
    if not keyed:
        return torch.full((qpos.shape[0], 0), total, dtype=torch.long, device=qpos.device)
    col = 0
    for j, seg in keyed:
        if first[j] != col:
            raise ValueError(f"first={first} must number the segments' indexer keys in order")
        col += seg.index_keys.shape[0]
    if col != total:
        raise ValueError(f"total={total} must be the number of indexer keys ({col})")
    q, w_raw = attn.indexer.query(h, qr)
    w = attn.indexer.head_weights(q, w_raw)              # once for every segment
    # every segment's scores land in their columns of one [T, total] block (no concatenation); segment j's
    # columns are first[j].. (checked above), so a column's index IS the entry's global id
    s = torch.empty((qpos.shape[0], total), dtype=torch.float32, device=h.device)
    T = qpos.shape[0]
    qs = q.clone() if keyed else None        # each segment's turned query, one after the other
    for j, seg in keyed:
        n = seg.index_keys.shape[0]
        cos, sin = _angles(attn, qpos, 0, T, seg.delta, trig)
        rope_(qs, cos, sin, src=q)
        attn.indexer.scores_roped(qs, None, _shifted(qpos, 0, T, seg.delta, trig), seg.index_keys,
                                  out=s[:, first[j]:first[j] + n], w=w)
    top = s.topk(min(attn.indexer.topk, s.shape[1]), dim=-1)
    return torch.where(torch.isinf(top.values), total, top.indices)


def _offsets(segments: list[SegmentKeys], attr: str) -> tuple[list[int], int]:
    """Global ids over every segment's `attr` ("entries" or "index_keys"): segment j's row w is first[j] + w; total
    = all rows. (A segment's indexer keys and entries come from compressors of the same ratio over the same rows,
    so the two numberings agree.)"""
    first, total = [], 0
    for s in segments:
        first.append(total)
        rows = getattr(s, attr)
        total += 0 if rows is None else rows.shape[0]
    return first, total


def _indexer_picks(attn, qpos, segments, idx_inputs, trig=None):
    """`_indexer_global_picks` split per segment: the picked local entry ids [T, k] (-1 = none) of each segment, in
    the top-k order (None for every segment when no segment has indexer keys), and the number of picks made."""
    first, total = _offsets(segments, "index_keys")
    if total == 0:
        return [None] * len(segments), 0
    gp = _indexer_global_picks(attn, qpos, segments, idx_inputs, first, total, trig)
    return split_picks(gp, first, total), (gp < total).sum()


def _rows_view(ts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """Where every tensor of `ts` ([n_j, w], contiguous, one dtype) lies in ONE storage on a whole row of width w
    counted from its start (LayerPrefetcher's buffer for a layer of pinned documents, `owned_copies`): a [R, w]
    view of that storage and each tensor's first row in it, so one index_copy_ / index_select serves every
    document. None otherwise (the caller goes document by document)."""
    if not ts or ts[0].dim() != 2:
        return None
    t0 = ts[0]
    st, w, es = t0.untyped_storage(), t0.shape[1], t0.element_size()
    firsts = []
    for t in ts:
        if (t.dim() != 2 or t.shape[1] != w or t.dtype != t0.dtype or not t.is_contiguous() or w == 0
                or t.untyped_storage().data_ptr() != st.data_ptr() or t.storage_offset() % w):
            return None
        firsts.append(t.storage_offset() // w)
    rows = st.nbytes() // (w * es)
    return torch.empty(0, dtype=t0.dtype, device=t0.device).set_(st, 0, (rows, w), (w, 1)), firsts


def _view_rows(sp, what, firsts: list[int], parts) -> torch.Tensor:
    """The rows in a `_rows_view` of `parts` [(ids of a document's rows, ...)] one after the other, given each
    document's first row: built once per request and layout (every layer of a kind has the same)."""
    return _memo(sp.view_rows, (what, tuple(firsts)),
                 lambda: torch.cat([ids + f for (ids, *_), f in zip(parts, firsts)]))


def _in_larger(t) -> bool:
    """Whether `t` is a view of a buffer holding more than it (a packed staged layer's field)."""
    return t is not None and t.untyped_storage().nbytes() > t.numel() * t.element_size()


def _keep_apart(segs: list[SegmentKeys], states: list[CompressorState], docs, i: int) -> None:
    """The request keeps every reusable layer's segment keys and carried compressor state to its end (later calls,
    decode). Where they are views of the request's own staged copy of a layer (`private`: LayerPrefetcher packs a
    layer's documents into ONE device buffer, W_a,L O_L and picks included), keeping a view would keep the whole
    buffer: they are copied out, one launch per field for all documents, and the buffer is freed with its layer."""
    for name in ("latent", "entries", "index_keys"):
        own = [s for j, s in enumerate(segs) if is_private(docs[j], i) and _in_larger(getattr(s, name))]
        ts = [getattr(s, name) for s in own]
        if not ts:
            continue
        if len({(t.dtype, t.shape[1:]) for t in ts}) == 1:
            parts = torch.cat(ts).split([t.shape[0] for t in ts])
        else:
            parts = [t.clone() for t in ts]
        for s, t in zip(own, parts):
            setattr(s, name, t)
    for st in states:
        for f in dataclass_fields(st):
            if _in_larger(getattr(st, f.name)):
                setattr(st, f.name, getattr(st, f.name).clone())


def rows_out(out, n: int, width: int, dtype: torch.dtype, device, who: str) -> torch.Tensor:
    """The [n, width] buffer rows are gathered into: `out` when given (it must be contiguous and of that shape and
    dtype), else a new one."""
    if out is None:
        return torch.empty((n, width), dtype=dtype, device=device)
    if out.shape != (n, width) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"{who}: out must be contiguous [{n}, {width}] {dtype}, got {tuple(out.shape)} "
                         f"{out.dtype}")
    return out


def gather_rows(parts, n: int, width: int, dtype: torch.dtype, device, out=None) -> torch.Tensor:
    """[n, width]: for each (src [m, width], ids, off) of `parts`, rows off.. of the result (`out`, given) =
    src[ids], gathered straight into place (no temporary per part). The parts must cover rows 0..n-1."""
    spans = sorted((off, off + ids.numel()) for _, ids, off in parts)
    ends = [0] + [b for _, b in spans]
    if [a for a, _ in spans] != ends[:-1] or ends[-1] != n:     # no row left unwritten, none written twice
        raise ValueError(f"the parts' row ranges {spans} must tile rows 0..{n - 1} exactly")
    out = rows_out(out, n, width, dtype, device, "gather_rows")
    for src, ids, off in parts:
        dst = out[off:off + ids.numel()]
        if src.dtype == dtype and src.device == dst.device:
            torch.index_select(src, 0, ids, out=dst)
        else:
            dst.copy_(src.index_select(0, ids.to(src.device)))
    return out


# ============================================================================ adaptive MoE fanout

def adaptive_fanout(w: torch.Tensor, idx: torch.Tensor, tau: float, min_experts: int):
    """Router top-k weights w and expert ids idx [T, k] -> (both sorted by decreasing weight, ids with the dropped
    slots set to -1, k per row): k = smallest k >= min_experts whose normalized cumulative weight reaches tau; the
    kept slots keep their original weights (SPEC §5)."""
    order = torch.argsort(w, dim=-1, descending=True, stable=True)
    w, idx = w.gather(1, order), idx.gather(1, order)
    cum = w.cumsum(-1) / w.sum(-1, keepdim=True)
    k = (cum < tau - 1e-6).sum(-1) + 1
    k = k.clamp(min=min_experts, max=w.shape[1])
    keep = torch.arange(w.shape[1], device=w.device)[None, :] < k[:, None]
    return w, torch.where(keep, idx, torch.full_like(idx, -1)), k


# ============================================================================ request state

# ============================================================================ per-request row plan

@dataclass
class _Rows:
    """The rows of one call (active rows, or the others), fixed for a request: their indices among the call's
    rows (None: all of them, in order), request positions on the device and on the host, and the RoPE angles each
    segment needs (per query chunk; built in the first reusable layer, reused by the others)."""
    idx: torch.Tensor | None
    pos: torch.Tensor
    pos_host: np.ndarray
    trig: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.pos_host.shape[0]

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.idx is None else t.index_select(0, self.idx)

    def put(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """dst with these rows replaced by src (out of place)."""
        return src if self.idx is None else dst.index_copy(0, self.idx, src.to(dst.dtype))

    def put_(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """These rows of dst replaced by src, in place (or src itself when these are all the rows)."""
        return src if self.idx is None else dst.index_copy_(0, self.idx, src.to(dst.dtype))


@dataclass
class _Split:
    """Active rows (every head, MoE) and the others (Global heads + restored Local), decided once per request;
    every index tensor the reusable layers need is built here, so the per-layer path has no host syncs."""
    act: _Rows | None
    rest: _Rows | None
    # relocated documents: per document (its index in docs, its active rows' local ids, their offset in the active
    # relocated rows) and (its other rows' local ids, their offset among the other rows)
    act_local: list = field(default_factory=list)
    rest_local: list = field(default_factory=list)
    act_reloc: torch.Tensor | None = None       # active relocated rows among the call's rows [n_ar]
    act_cpos: torch.Tensor | None = None        # their canonical positions in their own document
    blocks: dict = field(default_factory=dict)  # (ratio, overlap) -> _BlockPlan
    seg_ranges: list = field(default_factory=list)   # relocated documents: (start row, n)
    ra_host: torch.Tensor | None = None         # row_active on the host
    # one-view row ids (`_rows_view`): (what, the documents' first rows in the view) -> their rows in the view
    view_rows: dict = field(default_factory=dict)
    # where both kinds of rows exist: each call row's place in the split order (active rows, then the others),
    # in which the projected state is written (`_rows`)
    split_pos: torch.Tensor | None = None


@dataclass
class _BlockPlan:
    """Compressed blocks of the relocated documents to re-pool (blocks holding an active row) and the rows whose
    compressor projections that needs (with overlap: each such block's predecessor, and every document's last
    block, whose Ca half carries into the next segment). Indices into the stacked `needed` blocks."""
    need_rows: torch.Tensor                     # call rows to project, needed block after needed block
    n_need: int
    dirty_src: torch.Tensor                     # per dirty block: its index among the needed blocks
    dirty_pos: torch.Tensor                     # per dirty block: its first canonical position (block id x ratio)
    prev_src: torch.Tensor | None               # per dirty block: its predecessor's index + 1 (0 = the prefix's state)
    per_doc: list                               # (doc index, dirty block ids, offset among dirty blocks)
    carry: int                                  # the last document's last block among the needed blocks


@dataclass
class ReuseResult:
    logits: torch.Tensor
    ledger: Ledger
    active_rows: torch.Tensor                  # request positions of active relocated rows
    state: "RequestState"


@dataclass
class RequestState:
    """Everything a request needs to keep decoding: native caches for fence layers, segment keys (artifact +
    overlay) for reusable layers, and the new-rows segment's own latent and compressor state."""
    fence_caches: dict[int, LayerCache]
    seg_keys: dict[int, list[SegmentKeys]]              # reusable layer -> prefix + relocated segments
    new_latent: dict[int, torch.Tensor]
    new_comp: dict[int, CompressorState]
    new_index: dict[int, CompressorState]
    new_delta: int
    pos: int


class ReuseEngine:
    def __init__(self, model: Transformer, profile: ReuseProfile):
        profile.check(model.cfg)
        self.model, self.profile, self.cfg = model, profile, model.cfg
        n_heads = model.layers[0].attn.n_heads
        self.gmask = global_mask(self.cfg, profile, n_heads, model.par.rank)
        self._gm_ids: dict = {}
        self._gm_key = tuple(self.gmask.tolist())          # which heads are Global (host side)

    # ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, docs: list[DocumentArtifact], question: list[int]) -> ReuseResult:
        """The request's prefill through the reuse path. Its layers rotate the same position sets again and again
        (the active rows' canonical positions, the dirty blocks', the new rows'), so their RoPE angles are
        computed once for the request (`shared_angles`)."""
        with shared_angles():
            return self._prefill(docs, question)

    def _prefill(self, docs: list[DocumentArtifact], question: list[int]) -> ReuseResult:
        m, cfg, prof = self.model, self.cfg, self.profile
        dev = m.embed.weight.device
        prefix, reloc = docs[0], docs[1:]
        self._docs, self._deferred = docs, []
        deltas, pos = [], 0
        for d in docs:
            assert d.n % prof.align == 0, "artifacts are padded to the profile's alignment"
            deltas.append(pos)
            pos += d.n
        q_start = pos
        tokens = torch.tensor([t for d in reloc for t in d.tokens] + list(question), device=dev)
        positions = shared_arange(prefix.n, q_start + len(question), device=dev)
        n_reloc = q_start - prefix.n
        ledger = Ledger.start(cfg, prof, n_prefix=prefix.n, n_reloc=n_reloc, n_new=len(question))

        state = RequestState({}, {}, {}, {}, {}, q_start, q_start + len(question))
        x = m.embed_streams(tokens)
        deviation = torch.zeros(n_reloc, device=dev)
        idx_score = torch.zeros(n_reloc, device=dev)
        active = None
        for i, block in enumerate(m.layers):
            artifact_fence = (prof.last_fence_kv == "artifact" and i >= cfg.n_layers - prof.last_fences
                              and i >= prof.first_fences)
            if prof.is_fence(cfg, i) and not artifact_fence:
                lc = self._prefix_cache(block, prefix.layers[i])
                lc.capture = {} if i < prof.first_fences else None      # the first fences' latent and picks
                # the last layer, a fence, computes the last row's output only (as the recompute arm's does)
                out_rows = prefill_out_rows(cfg, i, lc)
                with phase("rk.fence"):
                    x = block(x, tokens, positions, lc, m.q_chunk, out_rows=out_rows)
                cap, lc.capture = lc.capture, None
                state.fence_caches[i] = lc
                ledger.fence_layer(i, rows=len(tokens), total_rows=q_start + len(question), out_rows=out_rows)
                if i < prof.first_fences and n_reloc:
                    deviation += self._deviation(block, cap["latent"][:n_reloc], reloc, deltas[1:], i)
                    if block.attn.kind == CSA and cap["topk"] is not None:
                        idx_score = torch.maximum(idx_score, self._indexer_rows(cap["topk"], n_reloc, prefix.n,
                                                                                len(question), block))
                continue
            if active is None:
                with phase("rk.select"):
                    active = self._choose_active(deviation, idx_score, reloc, deltas[1:], q_start, len(question))
                    split = self._split(active, positions, reloc, len(question))
                ledger.set_active(split.act_reloc.shape[0])
            x = self._reusable_layer(i, block, x, tokens, positions, docs, deltas, split, state, ledger,
                                     fence=artifact_fence)
        self._flush(ledger)
        logits = m.logits(x[-1:])[0]
        act_pos = positions[:n_reloc][active] if active is not None else positions[:0]
        return ReuseResult(logits, ledger, act_pos, state)

    # ------------------------------------------------------------------------------------------------
    def _prefix_cache(self, block: Block, art: LayerArtifact) -> LayerCache:
        """A native cache holding exactly what the prefix document left behind (padded: no compressor tail)."""
        W = self.cfg.window_size
        lc = LayerCache(window_kv=art.latent[-(W - 1):].clone() if W > 1 else art.latent[:0].clone())
        if block.attn.compressor is not None:
            lc.compressor = CompressorState(entries=art.entries.clone(),
                                            prev_kv=art.comp_prev[0] if art.comp_prev else None,
                                            prev_gate=art.comp_prev[1] if art.comp_prev else None)
        if block.attn.indexer is not None:
            lc.indexer = CompressorState(entries=art.index_keys.clone(),
                                         prev_kv=art.index_prev[0] if art.index_prev else None,
                                         prev_gate=art.index_prev[1] if art.index_prev else None)
        return lc

    def _deviation(self, block, latent_req, reloc, deltas, layer) -> torch.Tensor:
        """CacheBlend's signal for free: the request-context latent of the first fences against the artifact's
        latent of the same layer (moved to the request frame), relative per row."""
        outs = []
        a = 0
        for d, delta in zip(reloc, deltas):
            art = d.layers[layer].latent
            moved = Rotary.apply(art, *block.attn.rotary.cos_sin(torch.full((d.n,), delta, device=art.device)))
            got = latent_req[a:a + d.n]
            outs.append((got.float() - moved.float()).norm(dim=-1) / moved.float().norm(dim=-1).clamp_min(1e-12))
            a += d.n
        return torch.cat(outs)

    def _indexer_rows(self, topk, n_reloc, prefix_n, n_q, block) -> torch.Tensor:
        """Rows of the compressed blocks that the native indexer picks for the question rows, scored by how many
        question rows pick them."""
        score = torch.zeros(n_reloc, device=topk.device)
        picks = topk[-n_q:].flatten()
        picks = picks[picks >= 0]
        if picks.numel() == 0:
            return score
        rows = (picks[:, None] * 4 + torch.arange(4, device=picks.device)).flatten() - prefix_n
        rows = rows[(rows >= 0) & (rows < n_reloc)]
        score.index_add_(0, rows, torch.ones_like(rows, dtype=score.dtype))
        return score

    def _choose_active(self, deviation, idx_score, reloc, deltas, q_start, n_q) -> torch.Tensor:
        return choose_active(self.profile, deviation, idx_score, [d.n for d in reloc], deltas, q_start, n_q)

    # ------------------------------------------------------------------------------------------------
    def _split(self, active, positions, reloc, n_q) -> _Split:
        """Every per-request index the reusable layers use, built once on the host from one read of the active
        mask (the only host sync of the reuse layers' indices) and copied without waiting (`to_device_nowait`)."""
        dev = positions.device
        n_reloc = active.shape[0]
        row_active = torch.cat([active, torch.ones(n_q, dtype=torch.bool, device=dev)])
        ra_host, pos_host = row_active.cpu(), positions.cpu()
        act_h, rest_h = torch.nonzero(ra_host).flatten(), torch.nonzero(~ra_host).flatten()

        def rows(ids):
            if ids.numel() == 0:
                return None
            if ids.numel() == row_active.shape[0]:
                return _Rows(None, positions, pos_host.numpy())
            d = to_device_nowait(ids, dev)
            return _Rows(d, positions.index_select(0, d), pos_host[ids].numpy())
        sp = _Split(rows(act_h), rows(rest_h))
        if sp.act is not None and sp.rest is not None:
            split_pos = torch.empty(row_active.shape[0], dtype=torch.long)
            split_pos[act_h] = torch.arange(act_h.numel())
            split_pos[rest_h] = torch.arange(act_h.numel(), row_active.shape[0])
            sp.split_pos = to_device_nowait(split_pos, dev)
        a = n_act = n_rest = 0
        for j, d in enumerate(reloc, start=1):
            mine = ra_host[a:a + d.n]
            ai, ri = torch.nonzero(mine).flatten(), torch.nonzero(~mine).flatten()
            if ai.numel():
                sp.act_local.append((j, to_device_nowait(ai, dev), n_act))
            if ri.numel():
                sp.rest_local.append((j, to_device_nowait(ri, dev), n_rest))
            sp.seg_ranges.append((a, d.n))
            n_act, n_rest, a = n_act + ai.numel(), n_rest + ri.numel(), a + d.n
        ar = act_h[act_h < n_reloc]
        sp.act_reloc = to_device_nowait(ar, dev)
        starts = torch.tensor([st for st, _ in sp.seg_ranges], dtype=torch.long)
        owner = torch.searchsorted(starts, ar, right=True) - 1
        sp.act_cpos = share_positions(to_device_nowait(ar - starts[owner] if ar.numel() else ar, dev))
        sp.ra_host = ra_host
        for i in self.profile.reusable_layers(self.cfg):       # every compressor geometry, before the first layer
            attn = self.model.layers[i].attn
            for comp in (attn.compressor, attn.indexer.compressor if attn.indexer is not None else None):
                if comp is not None:
                    self._block_plan(sp, comp.ratio, comp.overlap)
        return sp

    def _block_plan(self, sp: _Split, r: int, overlap: bool) -> _BlockPlan:
        if (r, overlap) in sp.blocks:
            return sp.blocks[(r, overlap)]
        ra = sp.ra_host
        need_rows, dirty_src, dirty_pos, prev_src, per_doc = [], [], [], [], []
        n_need, carry = 0, -1
        last_of_prev = 0                                  # predecessor of a document's first block: 0 = prefix
        for j, (a, n) in enumerate(sp.seg_ranges, start=1):
            nb = n // r
            blk = ra[a:a + nb * r].view(nb, r).any(dim=1)
            needed = blk.clone()
            if overlap:
                needed[:-1] |= blk[1:]
                needed[-1] = True
            ids = torch.nonzero(needed).flatten()
            where = torch.full((nb,), -1, dtype=torch.long)
            where[ids] = torch.arange(n_need, n_need + ids.numel())
            need_rows.append((a + ids[:, None] * r + torch.arange(r)).flatten())
            B = torch.nonzero(blk).flatten()
            if B.numel():
                per_doc.append((j, B, sum(x.numel() for x in dirty_src)))
                dirty_src.append(where[B])
                dirty_pos.append(B * r)
                if overlap:
                    prev = torch.where(B > 0, where[(B - 1).clamp(min=0)] + 1, torch.full_like(B, last_of_prev))
                    prev_src.append(prev)
            if overlap:
                carry = int(where[nb - 1])
                last_of_prev = carry + 1
            n_need += ids.numel()
        dev = sp.act_reloc.device
        cat = (lambda xs: to_device_nowait(torch.cat(xs), dev) if xs else torch.zeros(0, dtype=torch.long, device=dev))
        plan = _BlockPlan(cat(need_rows), n_need, cat(dirty_src), share_positions(cat(dirty_pos)),
                          cat(prev_src) if overlap else None,
                          [(j, to_device_nowait(B, dev), off) for j, B, off in per_doc], carry)
        sp.blocks[(r, overlap)] = plan
        return plan

    def _defer(self, ledger, method: str, *args) -> None:
        """Ledger counts that are device tensors are settled once at the end of the request (no per-layer sync)."""
        if ledger is not None:
            self._deferred.append((getattr(ledger, method), args))

    def _flush(self, ledger) -> None:
        calls, self._deferred = self._deferred, []
        tensors = [a for _, args in calls for a in args if isinstance(a, torch.Tensor)]
        vals = iter(torch.stack([t.double() for t in tensors]).tolist()) if tensors else iter(())
        for fn, args in calls:
            fn(*[next(vals) if isinstance(a, torch.Tensor) else a for a in args])

    def _reusable_layer(self, i, block, x, tokens, positions, docs, deltas, split, state, ledger, fence=False):
        """Prefill of one reusable layer (or, with `fence`, a last fence taking non-active rows' KV from the
        artifact): build the relocated segments' keys, then one pass over the rows."""
        attn = block.attn
        n_reloc = sum(n for _, n in split.seg_ranges)
        with phase("rk.hc"):
            h, post, comb = block.hc_pre(x, "attn")
            hn = block.attn_norm(h)
        with phase("rk.keys"):
            segs, comp_state, idx_state = self._relocated_keys(i, attn, hn, docs, deltas, split, ledger)
            if any(is_private(d, i) for d in docs):
                _keep_apart(segs, [comp_state, idx_state], docs, i)
        state.seg_keys[i] = segs
        state.new_comp[i], state.new_index[i] = comp_state, idx_state
        state.new_latent[i] = hn.new_zeros((0, self.cfg.head_dim))
        return self._rows(i, block, x, hn, post, comb, tokens, split, n_reloc, state, ledger,
                          docs if n_reloc and not fence else None, fence)

    @torch.inference_mode()
    def generate(self, docs: list[DocumentArtifact], question: list[int], max_new_tokens: int,
                 eos: int | None = None) -> tuple[list[int], ReuseResult]:
        """Greedy answer through the reuse path: reuse prefill, then decode steps over the kept request state."""
        eos = self.cfg.eos_token_id if eos is None else eos
        res = self.prefill(docs, question)
        logits, out = res.logits, []
        for _ in range(max_new_tokens):
            nxt = int(logits.argmax())
            out.append(nxt)
            if nxt == eos:
                break
            logits = self.decode(res.state, nxt)
        return out, res

    @torch.inference_mode()
    def decode(self, state: RequestState, token: int) -> torch.Tensor:
        """One new row after a reuse prefill: fences native, reusable layers over the kept segment keys."""
        m = self.model
        dev = m.embed.weight.device
        tokens = torch.tensor([token], device=dev)
        positions = torch.tensor([state.pos], device=dev)
        x = m.embed_streams(tokens)
        one = _Split(_Rows(None, positions, np.array([state.pos])), None)
        for i, block in enumerate(m.layers):
            if i in state.fence_caches:
                x = block(x, tokens, positions, state.fence_caches[i], m.q_chunk)
                continue
            h, post, comb = block.hc_pre(x, "attn")
            x = self._rows(i, block, x, block.attn_norm(h), post, comb, tokens, one, 0, state, None, None,
                           self.profile.is_fence(self.cfg, i))
        state.pos += 1
        return m.logits(x)[0]

    def _relocated_keys(self, i, attn, hn, docs, deltas, sp: _Split, ledger):
        """Keys of the prefix (its artifact) and of every relocated segment (artifact, with the active rows'
        recomputed latent and their blocks' re-pooled entries overlaid on copies, or in place on the request's own
        staged copies: `_writable`); returns the compressor states carried to the new rows' segment. The active
        rows of all documents go through one projection."""
        arts0 = docs[0].layers[i]
        segs = [SegmentKeys(0, arts0.latent, arts0.entries, arts0.index_keys)]
        latents = {j: docs[j].layers[i].latent for j in range(1, len(docs))}
        if sp.act_local:
            fresh = attn.latent(hn.index_select(0, sp.act_reloc), sp.act_cpos)
            if not self._overlay_one_view(sp, docs, i, "latent", latents, [(ids, j) for j, ids, _ in sp.act_local],
                                          fresh):
                for j, ids, off in sp.act_local:
                    latents[j] = self._writable(docs, j, i, latents[j]).index_copy_(
                        0, ids, fresh[off:off + ids.numel()].to(latents[j].dtype))
            self._defer(ledger, "latent_rows", sp.act_reloc.shape[0])
        entries = {j: docs[j].layers[i].entries for j in range(1, len(docs))}
        index_keys = {j: docs[j].layers[i].index_keys for j in range(1, len(docs))}
        comp_state, idx_state = CompressorState(), CompressorState()
        if attn.compressor is not None:
            with phase("rk.keys.comp"):
                comp_state = self._overlay_entries(attn.compressor, hn, sp, entries, arts0.comp_prev, docs, i)
        if attn.indexer is not None:
            with phase("rk.keys.index"):
                idx_state = self._overlay_entries(attn.indexer.compressor, hn, sp, index_keys, arts0.index_prev,
                                                  docs, i)
        for j, delta in zip(range(1, len(docs)), deltas[1:]):
            segs.append(SegmentKeys(delta, latents[j], entries[j], index_keys[j]))
        return segs, comp_state, idx_state

    def _overlay_one_view(self, sp, docs, i, what, fields: dict, parts, fresh) -> bool:
        """Rows `fresh` (document after document, `parts` [(their local ids, j)]) written into `fields[j]` with ONE
        index_copy_ where every document's field lies in one `_rows_view` and is this request's own copy; False
        (nothing written) otherwise."""
        js = [j for _, j in parts]
        if not all(is_private(docs[j], i) for j in js):
            return False
        view = _rows_view([fields[j] for j in js])
        if view is None:
            return False
        rows, firsts = view
        rows.index_copy_(0, _view_rows(sp, what, firsts, parts), fresh.to(rows.dtype))
        return True

    @staticmethod
    def _writable(docs, j: int, i: int, t: torch.Tensor) -> torch.Tensor:
        """`t` (a field of document j's layer i) to overlay rows on: itself where the layers are this request's own
        staged copies (LayerPrefetcher / GroupStager on CUDA, `private`), else a copy, so an artifact the caller
        keeps is never written."""
        return t if is_private(docs[j], i) else t.clone()

    def _overlay_entries(self, comp, hn, sp: _Split, entries: dict, prefix_prev, docs, i) -> CompressorState:
        """Re-pool, for every relocated document at once, the compressed entries of blocks holding any active row
        from the current hidden states (the overlap half carried across each join from the previous segment),
        replacing `entries[j]` by a copy (`_writable`) with those blocks overlaid; only the needed blocks' rows are
        projected. Returns the compressor state carried into the new rows' segment."""
        r, D = comp.ratio, comp.dim
        plan = self._block_plan(sp, r, comp.overlap)
        carried = CompressorState(prev_kv=None if prefix_prev is None else prefix_prev[0],
                                  prev_gate=None if prefix_prev is None else prefix_prev[1])
        if plan.n_need == 0:
            return carried
        with phase("rk.pool.project"):
            kv, gate = comp.project(hn.index_select(0, plan.need_rows))
        ck, cg = kv.view(plan.n_need, r, -1), gate.view(plan.n_need, r, -1) + comp.ape
        if plan.dirty_src.numel():
            prev_kv = prev_gate = None
            if comp.overlap:   # slot 0: the prefix's carried half (none: weight 0), then every needed block's Ca half
                pk0 = ck.new_zeros((1, r, D)) if prefix_prev is None else prefix_prev[0].to(ck.dtype)[None]
                pg0 = cg.new_full((1, r, D), NEG_INF) if prefix_prev is None else prefix_prev[1].to(cg.dtype)[None]
                prev_kv = torch.cat([pk0, ck[:, :, :D]]).index_select(0, plan.prev_src)
                prev_gate = torch.cat([pg0, cg[:, :, :D]]).index_select(0, plan.prev_src)
            with phase("rk.pool.pool"):
                fresh = comp.pool(ck.index_select(0, plan.dirty_src), cg.index_select(0, plan.dirty_src), prev_kv,
                                  prev_gate, plan.dirty_pos)
            with phase("rk.pool.copy"):
                what = ("entries", comp.ratio, comp.dim)
                if not self._overlay_one_view(sp, docs, i, what, entries, [(B, j) for j, B, _ in plan.per_doc],
                                              fresh):
                    for j, B, off in plan.per_doc:
                        entries[j] = self._writable(docs, j, i, entries[j]).index_copy_(
                            0, B, fresh[off:off + B.numel()].to(entries[j].dtype))
        if comp.overlap:
            carried.prev_kv, carried.prev_gate = ck[plan.carry, :, :D].clone(), cg[plan.carry, :, :D].clone()
        return carried

    def _rows(self, i, block, x, hn, post, comb, tokens, sp: _Split, n_reloc, state, ledger, docs, fence):
        """One layer over the rows of this call: rows [0, n_reloc) are relocated rows (active or not), the rest
        new rows, whose latent and compressor state extend the request's own segment. Active rows: every head,
        MoE (adaptive fanout, or native top-k in a fence); other rows: Global heads + restored W_a,L O_L, FFN per
        ffn_mode; in an artifact-KV fence, other rows are not computed at all."""
        cfg, prof, attn = self.cfg, self.profile, block.attn
        M = x.shape[0]
        nrows = slice(n_reloc, M)
        with phase("rk.new_keys"):
            base = state.new_latent[i].shape[0]
            ncpos = shared_arange(base, base + M - n_reloc, device=x.device)
            state.new_latent[i] = torch.cat([state.new_latent[i], attn.latent(hn[nrows], ncpos).to(hn.dtype)])
            new_seg = SegmentKeys(state.new_delta, state.new_latent[i])
            if attn.compressor is not None:
                new_seg.entries = attn.compressor(hn[nrows], state.new_comp[i])
            if attn.indexer is not None:
                new_seg.index_keys = attn.indexer.compressor(hn[nrows], state.new_index[i])
            all_segs = state.seg_keys[i] + [new_seg]

        with phase("rk.wq_a"):
            qr = attn.q_norm(attn.wq_a(hn))
        act, rest = sp.act, (None if fence else sp.rest)
        pairs = 0
        # with both kinds of rows, the projected state is laid out in the split order (active rows, then the
        # others): each part's GEMM writes its own rows' block in place, and hc_post reads W_b's output through
        # `split_pos`, so no part is scattered into the rows' order through HBM; otherwise in the rows' order
        split = (rest is not None and sp.split_pos is not None         # split_pos: both kinds of rows exist
                 and hn.dtype == attn.wo_a.weight.dtype)
        P = (hn.new_zeros if sp.rest is not None and fence else hn.new_empty)((M, attn.n_groups * cfg.o_lora_rank))
        if act is not None:                        # every head, native W_a
            with phase("rk.attn.active"):
                qa = act.take(qr)
                q = unweighted_rms_norm(attn.wq_b(qa).view(-1, attn.n_heads, cfg.head_dim), cfg.norm_eps)
                o, p = self._attend(attn, q, act, all_segs, attn.attn_sink, act.take(hn) if attn.indexer else None,
                                    qa)
                if split:
                    attn.project_relative(o.to(hn.dtype), P[:act.n])
                else:
                    P = act.put_(P, attn.project_relative(o.to(hn.dtype)))
                pairs = pairs + p * attn.n_heads
        if rest is not None:                       # Global heads only, their slice of wq_b and of W_a
            pg = P[M - rest.n:] if split else None
            if docs is not None:                   # W_a,L O_L of these rows from their documents, in the rows' order
                with phase("rk.restore"):
                    pg = self._restored_local(i, sp, docs, rest.n, attn, pg)
            with phase("rk.attn.global"):
                gm = self._global_heads(x.device)
                Hg = gm.numel()
                wq = self._global_wq(attn, gm)
                qg = rest.take(qr)
                q = unweighted_rms_norm(torch.nn.functional.linear(qg.to(wq.dtype), wq).view(-1, Hg, cfg.head_dim),
                                        cfg.norm_eps)
                own = None
                if attn.kind == CSA and prof.global_picks == "artifact" and docs is not None:
                    own = self._own_picks(i, sp)
                o, p = self._attend(attn, q, rest, all_segs, attn.attn_sink.index_select(0, gm),
                                    rest.take(hn) if attn.indexer and own is None else None, qg, own)
                # + W_a,G O_G in the same GEMM (onto the restored rows), or written into the split layout's rows
                pg = self._project_global(attn, o.to(hn.dtype), pg, add=docs is not None)
            if not split:
                P = rest.put_(P, pg)
            pairs = pairs + p * Hg
        par = self.model.par.size                  # every rank holds its own heads
        self._defer(ledger, "reusable_layer", i, act.n if act else 0, 0 if fence or not sp.rest else sp.rest.n,
                    (0 if fence else int(self.gmask.sum())) * par, pairs * par,
                    (act.n if act else 0) if (fence or prof.global_picks == "artifact") else M)
        with phase("rk.output"):
            x_attn = block.hc_post(attn.output(P), x, post, comb, sp.split_pos if split else None)

        if fence or prof.ffn_mode == "skip":
            # only active rows have an FFN: the others keep the attention sub-block's output (residual identity),
            # or, in an artifact-KV fence, are not computed at all (their streams are left as they were)
            keep = x if fence and sp.rest is not None else x_attn
            if act is None:
                return keep
            with phase("rk.ffn"):
                xa = act.take(x_attn)
                h2, post2, comb2 = block.hc_pre(xa, "ffn")
                hn2, ta = block.ffn_norm(h2), act.take(tokens)
                if fence:
                    w, idx = block.ffn.gate(hn2, ta)
                    y = block.ffn.routed(hn2, w, idx) + block.ffn.shared_experts(hn2).float()
                    self._defer(ledger, "moe_rows", act.n, cfg.n_activated_experts)
                else:
                    y = self._moe_adaptive(block, hn2, ta, ledger)
                y = block.ffn.par.all_reduce(y).to(x.dtype)
                if keep is x or act.idx is None:
                    mixed = block.hc_post(y, xa, post2, comb2)
                    return act.put(keep, mixed) if keep is x else act.put_(keep, mixed)
                # the active rows' new streams written straight into their rows of this layer's own output
                return block.hc_post(y, xa, post2, comb2, out=keep, out_rows=act.idx)
        h2, post2, comb2 = block.hc_pre(x_attn, "ffn")
        hn2 = block.ffn_norm(h2)
        y = torch.zeros_like(hn2, dtype=torch.float32)
        if act is not None:
            y = act.put_(y, self._moe_adaptive(block, act.take(hn2), act.take(tokens), ledger))
        if rest is not None:
            hr, tr = rest.take(hn2), rest.take(tokens)
            if prof.ffn_mode == "native":
                yr = block.ffn.routed(hr, *block.ffn.gate(hr, tr)) + block.ffn.shared_experts(hr).float()
                self._defer(ledger, "moe_rows", rest.n, cfg.n_activated_experts)
            else:
                yr = block.ffn.shared_experts(hr).float()
                self._defer(ledger, "moe_rows", rest.n, 0)
            y = rest.put_(y, yr)
        y = block.ffn.par.all_reduce(y).to(x.dtype)
        return block.hc_post(y, x_attn, post2, comb2)

    def _attend(self, attn, q_raw, rows: _Rows, segs, sink, h, qr, own_picks=None):
        """segment_attention in query chunks of about q_chunk x n_heads (row, head) pairs (bounded temporaries
        at long context; the Global heads' calls take proportionally more rows per chunk), each chunk's output
        written into its rows of one [T, H, D] result (no concatenation). h: the rows' hidden states for the
        online indexer (None: no indexer, or `own_picks` in its place)."""
        T, pairs = q_raw.shape[0], 0
        step = max(1, self.model.q_chunk * attn.n_heads // q_raw.shape[1])
        res = q_raw.new_empty(q_raw.shape) if T > step or T == 0 else None
        for a in range(0, T, step):
            b = a + step
            o, p = segment_attention(attn, q_raw[a:b], rows.pos[a:b], segs, sink,
                                     (h[a:b], qr[a:b]) if h is not None else None, None,
                                     rows.pos_host[a:b], None if own_picks is None else own_picks[a:b],
                                     rows.trig.setdefault(a, {}), None if res is None else res[a:b],
                                     q_scratch=True, policy=self.model.policy)
            res = o if res is None else res
            pairs = pairs + p
        return res, pairs

    def _own_picks(self, i, sp: _Split) -> torch.Tensor:
        """[n_rest, k] entry ids: each non-active relocated row's own document's offline picks, in its own segment
        (its window still crosses the joins). Only relocated rows are non-active, in document order."""
        picks = [self._docs[j].layers[i].picks for j, _, _ in sp.rest_local]
        view = _rows_view(picks)
        if view is not None:                 # every document's picks in one buffer, all of one width: one gather
            rows, firsts = view
            return rows.index_select(0, _view_rows(sp, "picks", firsts, [(ids,) for _, ids, _ in sp.rest_local]))
        parts = [p.index_select(0, ids) for p, (_, ids, _) in zip(picks, sp.rest_local)]
        k = max(t.shape[1] for t in parts)
        return torch.cat([torch.nn.functional.pad(t, (0, k - t.shape[1]), value=-1) if t.shape[1] < k else t
                          for t in parts])

    def _global_heads(self, device) -> torch.Tensor:
        """Ids of the Global heads on `device`, copied there once (a copy from pageable memory syncs)."""
        if device not in self._gm_ids:
            self._gm_ids[device] = torch.nonzero(self.gmask).flatten().to(device)
        return self._gm_ids[device]

    def _global_wq(self, attn, gm: torch.Tensor) -> torch.Tensor:
        """[Hg*D, q_lora_rank]: the Global heads' rows of W_q,b, gathered once and kept on the weight while it is
        unchanged (`kept_on_weights`, as f32linear.stacked_pieces): a reusable layer's Global-head queries read them
        at every request."""
        w = attn.wq_b.weight
        return kept_on_weights((w,), "_rk_global_wq", lambda: w.view(attn.n_heads, self.cfg.head_dim, -1)
                               .index_select(0, gm).reshape(-1, w.shape[1]), self._gm_key)

    def _project_global(self, attn, o_g, local=None, add=True):
        """W_a,G O_G on outputs already de-rotated at their query positions: each group's W_a restricted to its
        Global heads' columns (a strided view of the weight, not a copy). With `local` (the rows' W_a,L O_L,
        `_restored_local`) the products are added to it in the GEMM: P = W_a,G O_G + W_a,L O_L rounded once; with
        `add` False, `local` is only where they are written."""
        cfg, prof = self.cfg, self.profile
        G, R, hpg, gpg = attn.n_groups, cfg.o_lora_rank, cfg.heads_per_group, prof.global_per_group
        w = attn.wo_a.weight.view(G, R, hpg, cfg.head_dim)[:, :, :gpg].reshape(G, R, gpg * cfg.head_dim)
        return grouped_projection(o_g.reshape(-1, G, gpg * cfg.head_dim).to(w.dtype), w, local, add)

    def _restored_local(self, i, sp: _Split, docs, n_rest: int, attn, out=None) -> torch.Tensor:
        """[n_rest, G*R] the non-active rows' W_a,L O_L from their documents' artifacts, in the rows' order
        (gathered into `out`, given: contiguous, of W_a's dtype)."""
        w = attn.wo_a.weight
        local = [docs[j].layers[i].local_p for j, _, _ in sp.rest_local]
        scales = [docs[j].layers[i].local_s for j, _, _ in sp.rest_local]
        if any(s is not None for s in scales):
            return self._dequantized_local(sp, local, scales, n_rest, attn, out)
        view = _rows_view(local)
        if view is not None and view[0].dtype == w.dtype and view[0].device == w.device:     # one gather
            rows, firsts = view
            ids = _view_rows(sp, "local_p", firsts, [(ids,) for _, ids, _ in sp.rest_local])
            return torch.index_select(rows, 0, ids, out=out)
        return gather_rows([(t, ids, off) for t, (j, ids, off) in zip(local, sp.rest_local)], n_rest,
                           attn.n_groups * self.cfg.o_lora_rank, w.dtype, w.device, out)

    def _dequantized_local(self, sp: _Split, local, scales, n_rest: int, attn, out=None) -> torch.Tensor:
        """`_restored_local` for FP8 artifacts (local_format="fp8"): the rows' codes and scales gathered and
        dequantized in one pass into W_a's dtype (`gather_dequant_rows`): one launch where every document's codes
        and scales each lie in one `_rows_view` (a staged layer), else one per document."""
        w = attn.wo_a.weight
        if any(s is None for s in scales) or any(t.element_size() != 1 for t in local):
            raise ValueError("an FP8 Local contribution needs its codes and scales in every document")
        out = rows_out(out, n_rest, attn.n_groups * self.cfg.o_lora_rank, w.dtype, w.device, "the FP8 restore")
        ids = [(ids,) for _, ids, _ in sp.rest_local]
        cview, sview = _rows_view(local), _rows_view(scales)
        if cview is not None and sview is not None and cview[0].device == w.device:
            return gather_dequant_rows(cview[0], sview[0], _view_rows(sp, "local_p", cview[1], ids),
                                       _view_rows(sp, "local_s", sview[1], ids), out)
        for c, s, (_, ids, off) in zip(local, scales, sp.rest_local):
            if c.device != w.device:                # the rows only, then to the device
                r = ids.to(c.device)
                c, s = c.view(torch.uint8).index_select(0, r).to(w.device), s.index_select(0, r).to(w.device)
                ids = torch.arange(r.numel(), device=w.device)
            gather_dequant_rows(c, s, ids, ids, out[off:off + ids.numel()])
        return out

    def _moe_adaptive(self, block, h, tokens, ledger) -> torch.Tensor:
        """Top-6 by the router, then k = smallest k >= min_experts whose normalized cumulative weight reaches
        tau; the k experts run with their original weights; the shared expert always runs."""
        prof = self.profile
        w, idx, k = adaptive_fanout(*block.ffn.gate(h, tokens), prof.tau, prof.min_experts)
        self._defer(ledger, "moe_rows", h.shape[0], k.float().mean())
        return block.ffn.routed(h, w, idx) + block.ffn.shared_experts(h).float()
