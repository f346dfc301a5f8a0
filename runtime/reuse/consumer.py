"""Online reuse path: one request = [doc 1 (prefix, Delta=0), doc 2..k (relocated), new rows (question, then
decoded tokens)]. See docs/reuse.md for what is cached, what is recomputed and how rows are chosen.

- The prefix document's state is its artifact in every layer (exact: causal attention never looks ahead).
- Fence layers run the native model over every non-prefix row, continuing from the prefix artifact's cache.
- Reusable layers: active rows run in full (all heads, latent recomputed into an overlay, MoE with adaptive
  fanout); other relocated rows restore W_a,L O_L from the artifact, compute the Global heads online, skip the
  FFN. Attention relocates each segment by rotating the query to t - Delta and the partial output by +Delta, and
  merges segments by log-sum-exp with the sink once. Artifacts are never rewritten or concatenated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from runtime.model.config import CSA, HCA
from runtime.model.deepseek_v4 import (NEG_INF, Block, CompressorState, LayerCache, Rotary, Transformer, _lse_attend,
                                       merge_with_sink, unweighted_rms_norm)
from runtime.kernels import enabled, sparse_mqa_attention
from .artifact import DocumentArtifact, LayerArtifact
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


def _window_part(attn, q, cpos, seg: SegmentKeys, scale):
    """q already rotated to the segment's frame; rows cpos-W+1..cpos clipped to the segment."""
    W, n = attn.cfg.window_size, seg.latent.shape[0]
    rows = cpos[:, None] - W + 1 + torch.arange(W, device=cpos.device)
    valid = (rows >= 0) & (rows < n)
    k = seg.latent[rows.clamp(0, max(n - 1, 0))]
    s = torch.einsum("thd,twd->thw", q, k.to(q.dtype)).float() * scale
    s = s.masked_fill(~valid[:, None, :], NEG_INF)
    return _lse_attend(s, k, "thw,twd->thd"), valid.sum()


class _OnlineMerge:
    """Running log-sum-exp merge of partial outputs over row subsets; the sink joins once at the end."""

    def __init__(self, T, H, D, device):
        self.lse = torch.full((T, H), NEG_INF, device=device)
        self.o = torch.zeros((T, H, D), device=device)

    def add(self, rows, o, lse):
        old = self.lse[rows]
        new = torch.logaddexp(old, lse)
        safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
        w_old = torch.where(torch.isinf(old), torch.zeros_like(old), torch.exp(old - safe))
        w_new = torch.where(torch.isinf(lse), torch.zeros_like(lse), torch.exp(lse - safe))
        self.o[rows] = self.o[rows] * w_old.unsqueeze(-1) + o.float() * w_new.unsqueeze(-1)
        self.lse[rows] = new

    def finish(self, sink):
        total = torch.logaddexp(self.lse, sink.float()[None, :])
        return self.o * torch.exp(self.lse - total).unsqueeze(-1)


def _pair_count(cl, seg, W, attn, mode, picks) -> torch.Tensor:
    """(query, key) pairs the fused kernel attends for these rows: clipped window rows plus visible entries."""
    n = seg.latent.shape[0]
    lo, hi = (cl - W + 1).clamp(min=0), cl.clamp(max=n - 1)
    total = (hi - lo + 1).clamp(min=0).sum()
    if mode == "causal":
        total = total + ((cl + 1) // attn.ratio).clamp(max=seg.entries.shape[0]).sum()
    elif mode == "picks":
        total = total + (picks >= 0).sum()
    return total


def segment_attention(attn, q_raw: torch.Tensor, qpos: torch.Tensor, segments: list[SegmentKeys], sink: torch.Tensor,
                      idx_inputs=None, picks: list | None = None,
                      qpos_host: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q_raw [T,H,D] normed, not yet roped; qpos request positions. Returns the merged per-head output in the
    request frame [T,H,D] (before the inverse output RoPE) and the number of (query, key) pairs attended (a
    tensor, so no host sync). A query works only on the segments it can see: a segment's window rows only for
    queries within W-1 rows past its end, its entries only for queries at or after its start."""
    T, H, D = q_raw.shape
    W = attn.cfg.window_size
    merge = _OnlineMerge(T, H, D, q_raw.device)
    pairs = torch.zeros((), dtype=torch.long, device=q_raw.device)
    cpos_all = [qpos - s.delta for s in segments]
    if attn.kind == CSA and picks is None:
        picks = _indexer_picks(attn, cpos_all, segments, idx_inputs)
    # rows come in increasing position: the rows a segment serves are contiguous, found on the host (no sync)
    host = (qpos.cpu() if qpos_host is None else qpos_host).contiguous()
    for j, seg in enumerate(segments):
        first = int(torch.searchsorted(host, seg.delta))
        if first == T:
            continue
        live = slice(first, T)
        cl = cpos_all[j][live]
        q = Rotary.apply(q_raw[live], *attn.rotary.cos_sin(cl))
        cos_d, sin_d = attn.rotary.cos_sin(torch.full((1,), seg.delta, device=qpos.device))

        def to_request(o):   # the segment's values carry RoPE at canonical positions
            return Rotary.apply(o, cos_d.expand(o.shape[0], -1), sin_d.expand(o.shape[0], -1))
        if enabled(q):   # fused: window rows and entries of this segment in one pass
            n_ent = 0 if seg.entries is None else seg.entries.shape[0]
            mode = "causal" if attn.kind == HCA and n_ent else "picks" if attn.kind == CSA and picks[j] is not None \
                else "none"
            o, lse = sparse_mqa_attention(q, seg.latent, cl, W, seg.entries if mode != "none" else None, mode,
                                          attn.ratio or 1, picks[j][live] if mode == "picks" else None, attn.scale)
            merge.add(live, to_request(o), lse)
            pairs = pairs + _pair_count(cl, seg, W, attn, mode, picks[j][live] if mode == "picks" else None)
            continue
        end = int(torch.searchsorted(host, seg.delta + seg.latent.shape[0] + W - 1))
        if end > first:
            near = slice(0, end - first)
            (o, lse), n = _window_part(attn, q[near], cl[near], seg, attn.scale)
            merge.add(slice(first, end), to_request(o), lse)
            pairs = pairs + n
        if attn.kind == HCA and seg.entries is not None and seg.entries.shape[0]:
            vis = torch.arange(seg.entries.shape[0], device=q.device)[None, :] < ((cl + 1) // attn.ratio)[:, None]
            s = torch.einsum("thd,nd->thn", q, seg.entries.to(q.dtype)).float() * attn.scale
            o, lse = _lse_attend(s.masked_fill(~vis[:, None, :], NEG_INF), seg.entries, "thn,nd->thd")
            merge.add(live, to_request(o), lse)
            pairs = pairs + vis.sum()
        elif attn.kind == CSA and picks[j] is not None:
            idx = picks[j][live]
            k = seg.entries[idx.clamp(min=0)]
            s = torch.einsum("thd,tkd->thk", q, k.to(q.dtype)).float() * attn.scale
            o, lse = _lse_attend(s.masked_fill((idx < 0)[:, None, :], NEG_INF), k, "thk,tkd->thd")
            merge.add(live, to_request(o), lse)
            pairs = pairs + (idx >= 0).sum()
    return merge.finish(sink), pairs


def _indexer_picks(attn, cpos_all, segments, idx_inputs):
    """Native lightning-indexer top-k over the union of every segment's visible entries, the indexer query
    rotated per segment; returns per segment the picked local entry ids [T, k] (-1 = none)."""
    h, qr = idx_inputs
    scores, seg_ids, local_ids = [], [], []
    for j, seg in enumerate(segments):
        if seg.index_keys is None or seg.index_keys.shape[0] == 0:
            continue
        N = seg.index_keys.shape[0]
        scores.append(attn.indexer.scores(h, qr, cpos_all[j], seg.index_keys))
        seg_ids.append(torch.full((N,), j, device=h.device))
        local_ids.append(torch.arange(N, device=h.device))
    out = [None] * len(segments)
    if not scores:
        return out
    s = torch.cat(scores, dim=1)
    seg_of, local = torch.cat(seg_ids), torch.cat(local_ids)
    top = s.topk(min(attn.indexer.topk, s.shape[1]), dim=-1)
    valid = ~torch.isinf(top.values)
    owner = seg_of[top.indices]
    for j in range(len(segments)):
        out[j] = torch.where(valid & (owner == j), local[top.indices], torch.full_like(top.indices, -1))
    return out


# ============================================================================ request state

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

    # ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, docs: list[DocumentArtifact], question: list[int]) -> ReuseResult:
        m, cfg, prof = self.model, self.cfg, self.profile
        dev = m.embed.weight.device
        prefix, reloc = docs[0], docs[1:]
        self._docs = docs
        deltas, pos = [], 0
        for d in docs:
            assert d.n % prof.align == 0, "artifacts are padded to the profile's alignment"
            deltas.append(pos)
            pos += d.n
        q_start = pos
        tokens = torch.tensor([t for d in reloc for t in d.tokens] + list(question), device=dev)
        positions = torch.arange(prefix.n, q_start + len(question), device=dev)
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
                lc.capture = {}
                x = block(x, tokens, positions, lc, m.q_chunk)
                cap, lc.capture = lc.capture, None
                state.fence_caches[i] = lc
                ledger.fence_layer(i, rows=len(tokens), total_rows=q_start + len(question))
                if i < prof.first_fences and n_reloc:
                    deviation += self._deviation(block, cap["latent"][:n_reloc], reloc, deltas[1:], i)
                    if block.attn.kind == CSA and cap["topk"] is not None:
                        idx_score = torch.maximum(idx_score, self._indexer_rows(cap["topk"], n_reloc, prefix.n,
                                                                                len(question), block))
                continue
            if active is None:
                active = self._choose_active(deviation, idx_score, reloc, deltas[1:], q_start, len(question))
                ledger.set_active(int(active.sum()))
            x = self._reusable_layer(i, block, x, tokens, positions, docs, deltas, active, state, ledger,
                                     fence=artifact_fence)
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
    def _reusable_layer(self, i, block, x, tokens, positions, docs, deltas, active, state, ledger, fence=False):
        """Prefill of one reusable layer (or, with `fence`, a last fence taking non-active rows' KV from the
        artifact): build the relocated segments' keys, then one pass over the rows."""
        attn = block.attn
        n_reloc = active.shape[0]
        h, post, comb = block.hc_pre(x, "attn")
        hn = block.attn_norm(h)
        segs, comp_state, idx_state = self._relocated_keys(i, attn, hn, docs, deltas, active, ledger)
        state.seg_keys[i] = segs
        state.new_comp[i], state.new_index[i] = comp_state, idx_state
        state.new_latent[i] = hn.new_zeros((0, self.cfg.head_dim))
        row_active = torch.cat([active, torch.ones(x.shape[0] - n_reloc, dtype=torch.bool, device=x.device)])
        local = torch.cat([d.layers[i].local_p for d in docs[1:]]) if n_reloc and not fence else None
        return self._rows(i, block, x, hn, post, comb, tokens, positions, row_active, n_reloc, state, ledger,
                          local, fence)

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
        one = torch.ones(1, dtype=torch.bool, device=dev)
        for i, block in enumerate(m.layers):
            if i in state.fence_caches:
                x = block(x, tokens, positions, state.fence_caches[i], m.q_chunk)
                continue
            h, post, comb = block.hc_pre(x, "attn")
            x = self._rows(i, block, x, block.attn_norm(h), post, comb, tokens, positions, one, 0, state, None,
                           None, self.profile.is_fence(self.cfg, i))
        state.pos += 1
        return m.logits(x)[0]

    def _relocated_keys(self, i, attn, hn, docs, deltas, active, ledger):
        """Keys of the prefix (its artifact) and of every relocated segment (artifact, with the active rows'
        recomputed latent and their blocks' re-pooled entries overlaid on copies); returns the compressor
        states carried to the new rows' segment."""
        arts0 = docs[0].layers[i]
        segs = [SegmentKeys(0, arts0.latent, arts0.entries, arts0.index_keys)]
        comp_state = CompressorState(prev_kv=_prev(arts0.comp_prev, 0), prev_gate=_prev(arts0.comp_prev, 1))
        idx_state = CompressorState(prev_kv=_prev(arts0.index_prev, 0), prev_gate=_prev(arts0.index_prev, 1))
        a = 0
        for d, delta in zip(docs[1:], deltas[1:]):
            art = d.layers[i]
            rows = slice(a, a + d.n)
            act = active[rows]
            latent = art.latent
            if act.any():
                cpos = torch.arange(d.n, device=hn.device)
                latent = art.latent.clone()
                latent[act] = attn.latent(hn[rows][act], cpos[act]).to(latent.dtype)
                ledger.latent_rows(int(act.sum()))
            seg = SegmentKeys(delta, latent, art.entries, art.index_keys)
            if attn.compressor is not None:
                seg.entries = self._overlay_entries(attn.compressor, hn[rows], act, art.entries, comp_state)
            if attn.indexer is not None:
                seg.index_keys = self._overlay_entries(attn.indexer.compressor, hn[rows], act, art.index_keys,
                                                       idx_state)
            segs.append(seg)
            a += d.n
        return segs, comp_state, idx_state

    def _rows(self, i, block, x, hn, post, comb, tokens, positions, row_active, n_reloc, state, ledger, local,
              fence):
        """One layer over the rows of this call: rows [0, n_reloc) are relocated rows (active or not), the rest
        new rows, whose latent and compressor state extend the request's own segment. Active rows: every head,
        MoE (adaptive fanout, or native top-k in a fence); other rows: Global heads + restored W_a,L O_L, FFN per
        ffn_mode; in an artifact-KV fence, other rows are not computed at all."""
        cfg, prof, attn = self.cfg, self.profile, block.attn
        M = x.shape[0]
        nrows = slice(n_reloc, M)
        base = state.new_latent[i].shape[0]
        ncpos = torch.arange(base, base + M - n_reloc, device=x.device)
        state.new_latent[i] = torch.cat([state.new_latent[i], attn.latent(hn[nrows], ncpos).to(hn.dtype)])
        new_seg = SegmentKeys(state.new_delta, state.new_latent[i])
        if attn.compressor is not None:
            new_seg.entries = attn.compressor(hn[nrows], state.new_comp[i])
        if attn.indexer is not None:
            new_seg.index_keys = attn.indexer.compressor(hn[nrows], state.new_index[i])
        all_segs = state.seg_keys[i] + [new_seg]

        qr = attn.q_norm(attn.wq_a(hn))
        P = hn.new_zeros((M, attn.n_groups * cfg.o_lora_rank))
        pairs = torch.zeros((), dtype=torch.long, device=x.device)
        rest = ~row_active
        ra_host, pos_host = row_active.cpu(), positions.cpu()     # row selection decided on the host, once
        if ra_host.any():                          # every head, native W_a
            q = unweighted_rms_norm(attn.wq_b(qr[row_active]).view(-1, attn.n_heads, cfg.head_dim), cfg.norm_eps)
            o, p = self._attend(attn, q, positions[row_active], all_segs, attn.attn_sink,
                                hn[row_active], qr[row_active], qpos_host=pos_host[ra_host])
            P[row_active] = attn.project(o.to(hn.dtype), positions[row_active]).to(P.dtype)
            pairs += p * attn.n_heads
        if not fence and not bool(ra_host.all()):  # Global heads only, their slice of wq_b and of W_a
            gm = self.gmask.to(x.device)
            Hg = int(gm.sum())
            wq = attn.wq_b.weight.view(attn.n_heads, cfg.head_dim, -1)[gm].reshape(Hg * cfg.head_dim, -1)
            q = unweighted_rms_norm(torch.nn.functional.linear(qr[rest].to(wq.dtype), wq).view(-1, Hg, cfg.head_dim),
                                    cfg.norm_eps)
            picks = None
            if attn.kind == CSA and self.profile.global_picks == "artifact" and not fence and local is not None:
                picks = self._own_picks(i, rest, n_reloc, len(all_segs))
            o, p = self._attend(attn, q, positions[rest], all_segs, attn.attn_sink[gm], hn[rest], qr[rest], picks,
                                qpos_host=pos_host[~ra_host])
            P[rest] = self._project_global(attn, o.to(hn.dtype), positions[rest]).to(P.dtype)
            pairs += p * Hg
            if local is not None:
                P[:n_reloc][rest[:n_reloc]] += local[rest[:n_reloc]].to(P.dtype)
        restore = rest[:n_reloc]
        x_attn = block.hc_post(attn.output(P), x, post, comb)
        if ledger is not None:
            online_idx = int(row_active.sum()) if (fence or self.profile.global_picks == "artifact") else M
            ledger.reusable_layer(i, active_rows=int(row_active.sum()), restored_rows=0 if fence else int(restore.sum()),
                                  global_heads=(0 if fence else int(self.gmask.sum())) * self.model.par.size,
                                  pairs=int(pairs) * self.model.par.size,   # every rank holds its own heads
                                  indexer_rows=online_idx)

        h2, post2, comb2 = block.hc_pre(x_attn, "ffn")
        hn2 = block.ffn_norm(h2)
        y = torch.zeros_like(hn2, dtype=torch.float32)
        if row_active.any():
            if fence:
                w, idx = block.ffn.gate(hn2[row_active], tokens[row_active])
                y[row_active] = block.ffn.routed(hn2[row_active], w, idx) + \
                    block.ffn.shared_experts(hn2[row_active]).float()
                if ledger is not None:
                    ledger.moe_rows(int(row_active.sum()), cfg.n_activated_experts)
            else:
                y[row_active] = self._moe_adaptive(block, hn2[row_active], tokens[row_active], ledger)
        rest = ~row_active
        if not fence and rest.any() and prof.ffn_mode == "native":
            y[rest] = block.ffn.routed(hn2[rest], *block.ffn.gate(hn2[rest], tokens[rest])) + \
                block.ffn.shared_experts(hn2[rest]).float()
            if ledger is not None:
                ledger.moe_rows(int(rest.sum()), cfg.n_activated_experts)
        elif not fence and rest.any() and prof.ffn_mode == "shared-expert-only":
            y[rest] = block.ffn.shared_experts(hn2[rest]).float()
            if ledger is not None:
                ledger.moe_rows(int(rest.sum()), 0)
        y = block.ffn.par.all_reduce(y).to(x.dtype)
        mixed = block.hc_post(y, x_attn, post2, comb2)
        if fence:
            # non-active rows are not computed in an artifact-KV fence: their streams are left as they were
            return torch.where(row_active[:, None, None], mixed, x)
        ffn_rows = row_active if prof.ffn_mode == "skip" else torch.ones_like(row_active)
        # skipped rows keep the attention sub-block's output and no FFN (residual identity)
        return torch.where(ffn_rows[:, None, None], mixed, x_attn)

    def _attend(self, attn, q_raw, qpos, segs, sink, h, qr, picks=None, qpos_host=None):
        """segment_attention in query chunks (bounded temporaries at long context)."""
        outs, pairs = [], torch.zeros((), dtype=torch.long, device=q_raw.device)
        step = self.model.q_chunk
        host = qpos.cpu() if qpos_host is None else qpos_host
        for a in range(0, q_raw.shape[0], step):
            b = a + step
            o, p = segment_attention(attn, q_raw[a:b], qpos[a:b], segs, sink,
                                     (h[a:b], qr[a:b]) if attn.indexer is not None else None,
                                     None if picks is None else [None if t is None else t[a:b] for t in picks],
                                     host[a:b])
            outs.append(o)
            pairs += p
        return torch.cat(outs), pairs

    def _own_picks(self, i, rest, n_reloc, n_segs):
        """Per segment [T_rest, k] entry ids: each non-active relocated row's own document's offline picks in its
        own segment, none elsewhere (its window still crosses the joins). Only relocated rows are non-active."""
        docs = self._docs
        rows = torch.nonzero(rest).flatten()
        k = max(d.layers[i].picks.shape[1] for d in docs[1:])
        out = [None] * n_segs
        a = 0
        for j, d in enumerate(docs[1:], start=1):
            mine = (rows >= a) & (rows < a + d.n)
            t = torch.full((rows.numel(), k), -1, dtype=torch.long, device=rest.device)
            pk = d.layers[i].picks.long()
            t[mine, :pk.shape[1]] = pk[rows[mine] - a]
            out[j] = t
            a += d.n
        return out

    def _project_global(self, attn, o_g, positions):
        """W_a,G O_G: inverse output RoPE, then each group's W_a restricted to its Global heads' columns."""
        cfg, prof = self.cfg, self.profile
        G, R, hpg, gpg = attn.n_groups, cfg.o_lora_rank, cfg.heads_per_group, prof.global_per_group
        o_g = Rotary.apply(o_g, *attn.rotary.cos_sin(positions), inverse=True)
        w = attn.wo_a.weight.view(G, R, hpg, cfg.head_dim)[:, :, :gpg].reshape(G, R, gpg * cfg.head_dim)
        return torch.einsum("tgi,gri->tgr", o_g.reshape(-1, G, gpg * cfg.head_dim).to(w.dtype), w).reshape(-1, G * R)

    def _overlay_entries(self, comp, h_rows, act, art_entries, state: CompressorState):
        """Re-pool the compressed entries of blocks holding any active row from the current hidden states (with
        the overlap half carried across the join from the previous segment) and keep the artifact's entries
        elsewhere. Only the needed blocks' rows (and, with overlap, their predecessors and the last block,
        whose Ca half carries into the next segment) are projected."""
        r, D = comp.ratio, comp.dim
        nb = act.shape[0] // r
        blk = act.view(nb, r).any(dim=1)
        rows_needed = blk.clone()
        if comp.overlap:
            rows_needed[:-1] |= blk[1:]
            rows_needed[-1] = True
        if not rows_needed.any():
            return art_entries
        ids = torch.nonzero(rows_needed).flatten()
        where = torch.full((nb,), -1, dtype=torch.long, device=act.device)
        where[ids] = torch.arange(ids.numel(), device=act.device)
        kv, gate = comp.project(h_rows.view(nb, r, -1)[ids].flatten(0, 1))
        ck, cg = kv.view(ids.numel(), r, -1), gate.view(ids.numel(), r, -1) + comp.ape
        prev_out = None
        if comp.overlap:
            last = where[nb - 1]
            prev_out = (ck[last, :, :D].clone(), cg[last, :, :D].clone())
        out = art_entries
        B = torch.nonzero(blk).flatten()
        if B.numel():
            prev_kv = prev_gate = None
            if comp.overlap:
                prev_kv = ck.new_zeros((B.numel(), r, D))
                prev_gate = cg.new_full((B.numel(), r, D), NEG_INF)
                has = B > 0
                src = where[(B - 1).clamp(min=0)]
                prev_kv[has], prev_gate[has] = ck[src[has], :, :D], cg[src[has], :, :D]
                if (~has).any() and state.prev_kv is not None:
                    prev_kv[~has], prev_gate[~has] = state.prev_kv, state.prev_gate
            fresh = comp.pool(ck[where[B]], cg[where[B]], prev_kv, prev_gate, B * r)
            out = art_entries.clone()
            out[B] = fresh.to(out.dtype)
        if comp.overlap:
            state.prev_kv, state.prev_gate = prev_out
        return out

    def _moe_adaptive(self, block, h, tokens, ledger) -> torch.Tensor:
        """Top-6 by the router, then k = smallest k >= min_experts whose normalized cumulative weight reaches
        tau; the k experts run with their original weights; the shared expert always runs."""
        prof, cfg = self.profile, self.cfg
        w, idx = block.ffn.gate(h, tokens)
        order = torch.argsort(w, dim=-1, descending=True, stable=True)
        w, idx = w.gather(1, order), idx.gather(1, order)
        cum = w.cumsum(-1) / w.sum(-1, keepdim=True)
        k = (cum < prof.tau - 1e-6).sum(-1) + 1
        k = k.clamp(min=prof.min_experts, max=w.shape[1])
        keep = torch.arange(w.shape[1], device=h.device)[None, :] < k[:, None]
        idx = torch.where(keep, idx, torch.full_like(idx, -1))
        if ledger is not None:
            ledger.moe_rows(h.shape[0], float(k.float().mean()))
        return block.ffn.routed(h, w, idx) + block.ffn.shared_experts(h).float()


def _prev(pair, i):
    return None if pair is None else pair[i]
