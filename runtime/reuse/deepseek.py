"""DeepSeek-V4's adapter of the reuse engine (engine.py; the request loop in loop.py): the per-layer math of one
request = [doc 1 (prefix, Delta=0), doc 2..k (relocated), new rows (question, then decoded tokens)]. See
docs/reuse.md for what is cached, what is recomputed and how rows are chosen.

- The prefix document's state is its artifact in every layer (exact: causal attention never looks ahead).
- Fence layers run the native model over every non-prefix row, continuing from the prefix artifact's cache.
- Reusable layers: active rows run in full (all heads, latent recomputed into an overlay, MoE with adaptive
  fanout); other relocated rows restore W_a,L O_L from the artifact, compute the Global heads online, skip the
  FFN. Attention relocates each segment by rotating the query to t - Delta and the partial output by +Delta, and
  merges segments by log-sum-exp with the sink once (segments.py). Artifacts are never rewritten or concatenated.

Everything that depends only on the request's rows (active/other split, per-document row ids, the blocks to
re-pool, RoPE angles) is built once per request (rows.py), so a reusable layer makes no host sync.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from runtime.model.config import CSA
from runtime.model.deepseek_v4 import (NEG_INF, Block, CompressorState, LayerCache, Transformer,
                                       grouped_projection, phase, prefill_out_rows, shared_angles, shared_arange,
                                       unweighted_rms_norm)
from runtime.kernels.f32linear import kept_on_weights
from runtime.kernels.fp8_rows import gather_dequant_rows
from .artifact import DocumentArtifact, LayerArtifact, Owner
from .call import Call, LayerRows, RequestState
from .controller import doc_offsets
from .draft import draft_rows
from .fanout import adaptive_fanout
from .keys import SegmentKeys
from .ledger import Ledger
from .loop import Pass, ReuseResult
from .producer import PRODUCER_VERSION
from .profile import ReuseProfile
from .roles import channel_range, global_mask
from .rows import Rows, Split, block_plan, split_rows
from .segments import fused_call, segment_attention
from .signals import deviation as fence_deviation, indexer_rows
from .views import gather_rows, keep_apart, rows_out, rows_view, view_rows


def expectations(model: Transformer, profile: ReuseProfile, fingerprint: str = "") -> dict:
    """What a consumer on this rank of `model` requires of a certificate (`certificate.validate`'s keywords but
    the token hash and generation): the checkpoint fingerprint, the profile, the TP geometry, every layer, the
    model's dtype and this producer."""
    cfg, par = model.cfg, model.par
    return dict(fingerprint=fingerprint, profile=profile.to_dict(), tp_size=par.size, tp_rank=par.rank,
                channel_range=channel_range(cfg, par.rank, par.size), layers_needed=list(range(cfg.n_layers)),
                dtype=str(model.dtype).removeprefix("torch."), producer_version=PRODUCER_VERSION)


class DeepSeekAdapter:
    """DeepSeek-V4's side of the reuse engine over one model and profile: it holds only what every request shares
    (the model, the profile, the Global heads); each prefill is a `DeepSeekPass`, each call's state its own
    (`Call`, `RequestState`), so concurrent requests may share one adapter."""
    family = "deepseek_v4"

    def __init__(self, model: Transformer, profile: ReuseProfile, mode: str = "reuse"):
        if mode != "reuse":
            raise ValueError(f"mode={mode!r}: the DeepSeek-V4 engine runs the reuse arm only (its naive baseline is "
                             f"measured on the Llama family, runtime/eval)")
        profile.check(model.cfg)
        self.model, self.profile, self.cfg = model, profile, model.cfg
        n_heads = model.layers[0].attn.n_heads
        self.gmask = global_mask(self.cfg, profile, n_heads, model.par.rank)
        self._gm_ids: dict = {}
        self._gm_key = tuple(self.gmask.tolist())          # which heads are Global (host side)

    def expectations(self, fingerprint: str = "") -> dict:
        return expectations(self.model, self.profile, fingerprint)

    def stop_tokens(self) -> set[int]:
        return {self.cfg.eos_token_id}

    def scope(self):
        """A request's layers rotate the same position sets again and again (the active rows' canonical positions,
        the dirty blocks', the new rows'): their RoPE angles are computed once for the request."""
        return shared_angles()

    def begin(self, docs: list[DocumentArtifact], question: list[int]) -> "DeepSeekPass":
        return DeepSeekPass(self, docs, question)

    def cache_pass(self, docs, question, reloc=None):
        raise ValueError("the DeepSeek-V4 reuse path reads every segment where it lies (SPEC §5: the stored latent is "
                         "never rewritten or concatenated): it has no request-cache path; use prefill")

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

    # ------------------------------------------------------------------------------------------------
    def _geometries(self) -> list[tuple[int, bool]]:
        """(ratio, overlap) of every compressor in the reusable layers: the blocks `split_rows` plans."""
        out = []
        for i in self.profile.reusable_layers(self.cfg):
            attn = self.model.layers[i].attn
            for comp in (attn.compressor, attn.indexer.compressor if attn.indexer is not None else None):
                if comp is not None:
                    out.append((comp.ratio, comp.overlap))
        return out

    def _reusable_layer(self, call: Call, i, block, x, tokens, deltas, split, state, fence=False):
        """Prefill of one reusable layer (or, with `fence`, a last fence taking non-active rows' KV from the
        artifact): build the relocated segments' keys, then one pass over the rows."""
        attn, docs = block.attn, call.docs
        n_reloc = sum(n for _, n in split.seg_ranges)
        with phase("rk.hc"):
            h, post, comb = block.hc_pre(x, "attn")
            hn = block.attn_norm(h)
        with phase("rk.keys"):
            segs, comp_state, idx_state = self._relocated_keys(call, i, attn, hn, deltas, split)
            if any(d.layers[i].owner is Owner.REQUEST for d in docs):
                keep_apart(segs, [comp_state, idx_state], docs, i)
        state.seg_keys[i] = segs
        state.new_comp[i], state.new_index[i] = comp_state, idx_state
        state.new_latent[i] = hn.new_zeros((0, self.cfg.head_dim))
        return self._rows(call, LayerRows(i, block, x, hn, post, comb, tokens, split, n_reloc,
                                           bool(n_reloc) and not fence, fence), state)

    @torch.inference_mode()
    def decode_batch(self, states: list[RequestState], tokens: list[int]) -> torch.Tensor:
        """One new row for each of B requests after their reuse prefills through this adapter (one profile: the
        same fence layers); returns their logits [B, vocab]. Fences: the native layer over each request's own
        cache, batched (Block.decode). Reusable layers: the row-wise work (mHC, W_q, W_a, W_b, the FFN) once for
        the batch; each request's new keys and segment attention over its own kept segments. Equal, request by
        request, to each one's step alone (up to the rounding of batched products)."""
        m = self.model
        dev = m.embed.weight.device
        at = [s.pos for s in states]
        tok = torch.tensor(tokens, device=dev)
        positions = torch.tensor(at, device=dev)
        rows = Split(Rows(None, positions, np.array(at)), None)
        x = m.embed_streams(tok)
        call = Call(None, None)
        for i, block in enumerate(m.layers):
            if i in states[0].fence_caches:
                x = block.decode(x, tok, positions, at, [s.fence_caches[i] for s in states])
                continue
            h, post, comb = block.hc_pre(x, "attn")
            x = self._decode_layer(call, LayerRows(i, block, x, block.attn_norm(h), post, comb, tok, rows, 0, False,
                                                   self.profile.is_fence(self.cfg, i)), states)
        for s in states:
            s.pos += 1
        return m.logits(x)

    def _decode_layer(self, call: Call, lr: LayerRows, states: list[RequestState]) -> torch.Tensor:
        """A reusable layer (or an artifact-KV fence) of a decode step: row b is request b's new row, active (every
        head, MoE); its latent and compressor states join request b's own segment, and it attends over request
        b's segments; everything else runs once for the batch (as `_rows` does for one call's rows)."""
        attn, cfg, B = lr.block.attn, self.cfg, lr.x.shape[0]
        with phase("rk.wq_a"):
            qr = attn.q_norm(attn.wq_a(lr.hn))
        with phase("rk.attn.active"):
            q = unweighted_rms_norm(attn.wq_b(qr).view(B, attn.n_heads, cfg.head_dim), cfg.norm_eps)
            o = q.new_empty(q.shape)
            act = lr.sp.act
            for b, state in enumerate(states):
                one = slice(b, b + 1)
                segs = self._new_keys(replace(lr, x=lr.x[one], hn=lr.hn[one]), state)
                o[one] = self._attend(attn, q[one], Rows(None, act.pos[one], act.pos_host[one]), segs,
                                      attn.attn_sink, lr.hn[one] if attn.indexer else None, qr[one])[0]
            P = attn.project_relative(o.to(lr.hn.dtype))
        with phase("rk.output"):
            x_attn = lr.block.hc_post(attn.output(P), lr.x, lr.post, lr.comb)
        if lr.fence or self.profile.ffn_mode == "skip":
            return self._active_ffn(call, lr, x_attn)
        return self._ffn(call, lr, x_attn)

    def _relocated_keys(self, call: Call, i, attn, hn, deltas, sp: Split):
        """Keys of the prefix (its artifact) and of every relocated segment (artifact, with the active rows'
        recomputed latent and their blocks' re-pooled entries overlaid on copies, or in place on the request's own
        staged copies: `_writable`); returns the compressor states carried to the new rows' segment. The active
        rows of all documents go through one projection."""
        docs = call.docs
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
            call.defer("latent_rows", sp.act_reloc.shape[0])
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
        index_copy_ where every document's field lies in one `rows_view` and is this request's own copy; False
        (nothing written) otherwise."""
        js = [j for _, j in parts]
        if not all(docs[j].layers[i].owner is Owner.REQUEST for j in js):
            return False
        view = rows_view([fields[j] for j in js])
        if view is None:
            return False
        rows, firsts = view
        rows.index_copy_(0, view_rows(sp, what, firsts, parts), fresh.to(rows.dtype))
        return True

    @staticmethod
    def _writable(docs, j: int, i: int, t: torch.Tensor) -> torch.Tensor:
        """`t` (a field of document j's layer i) to overlay rows on: itself where the layers are this request's own
        staged copies (`Owner.REQUEST`: LayerPrefetcher / GroupStager on CUDA, `owned_copy`), else a copy, so an
        artifact the caller keeps is never written."""
        return t if docs[j].layers[i].owner is Owner.REQUEST else t.clone()

    def _overlay_entries(self, comp, hn, sp: Split, entries: dict, prefix_prev, docs, i) -> CompressorState:
        """Re-pool, for every relocated document at once, the compressed entries of blocks holding any active row
        from the current hidden states (the overlap half carried across each join from the previous segment),
        replacing `entries[j]` by a copy (`_writable`) with those blocks overlaid; only the needed blocks' rows are
        projected. Returns the compressor state carried into the new rows' segment."""
        r, D = comp.ratio, comp.dim
        plan = block_plan(sp, r, comp.overlap)
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

    def _rows(self, call: Call, lr: LayerRows, state: RequestState) -> torch.Tensor:
        """One layer over the rows of this call: rows [0, n_reloc) are relocated rows (active or not), the rest
        new rows, whose latent and compressor state extend the request's own segment. Active rows: every head,
        MoE (adaptive fanout, or native top-k in a fence); other rows: Global heads + restored W_a,L O_L, FFN per
        ffn_mode; in an artifact-KV fence, other rows are not computed at all."""
        sp, attn = lr.sp, lr.block.attn
        segs = self._new_keys(lr, state)
        with phase("rk.wq_a"):
            qr = attn.q_norm(attn.wq_a(lr.hn))
        # with both kinds of rows, the projected state is laid out in the split order (active rows, then the
        # others): each part's GEMM writes its own rows' block in place, and hc_post reads W_b's output through
        # `split_pos`, so no part is scattered into the rows' order through HBM; otherwise in the rows' order
        split = (lr.rest is not None and sp.split_pos is not None         # split_pos: both kinds of rows exist
                 and lr.hn.dtype == attn.wo_a.weight.dtype)
        M = lr.x.shape[0]
        new = lr.hn.new_zeros if sp.rest is not None and lr.fence else lr.hn.new_empty
        P = new((M, attn.n_groups * self.cfg.o_lora_rank))
        P, pairs_a = self._active_attention(lr, segs, qr, P, split)
        P, pairs_g = self._global_attention(call, lr, segs, qr, P, split)
        par = self.model.par.size                  # every rank holds its own heads
        act, rest_n = sp.act.n if sp.act else 0, 0 if lr.fence or not sp.rest else sp.rest.n
        call.defer("reusable_layer", lr.i, act, rest_n, (0 if lr.fence else int(self.gmask.sum())) * par,
                   (pairs_a + pairs_g) * par, act if (lr.fence or self.profile.global_picks == "artifact") else M)
        with phase("rk.output"):
            x_attn = lr.block.hc_post(attn.output(P), lr.x, lr.post, lr.comb, sp.split_pos if split else None)
        if lr.fence or self.profile.ffn_mode == "skip":
            return self._active_ffn(call, lr, x_attn)
        return self._ffn(call, lr, x_attn)

    def _new_keys(self, lr: LayerRows, state: RequestState) -> list[SegmentKeys]:
        """The new rows' latent and compressor state appended to the request's own segment; every segment's keys
        in this layer (prefix, relocated, new)."""
        attn, i, nrows = lr.block.attn, lr.i, slice(lr.n_reloc, lr.x.shape[0])
        with phase("rk.new_keys"):
            base = state.new_latent[i].shape[0]
            ncpos = shared_arange(base, base + lr.x.shape[0] - lr.n_reloc, device=lr.x.device)
            state.new_latent[i] = torch.cat([state.new_latent[i], attn.latent(lr.hn[nrows], ncpos).to(lr.hn.dtype)])
            new_seg = SegmentKeys(state.new_delta, state.new_latent[i])
            if attn.compressor is not None:
                new_seg.entries = attn.compressor(lr.hn[nrows], state.new_comp[i])
            if attn.indexer is not None:
                new_seg.index_keys = attn.indexer.compressor(lr.hn[nrows], state.new_index[i])
        return state.seg_keys[i] + [new_seg]

    def _active_attention(self, lr: LayerRows, segs, qr, P, split: bool):
        """The active rows' attention, every head, through the native W_a, into their rows of P (its first block
        in the split layout). Returns P and the (query, key, head) triples attended."""
        act, attn, cfg = lr.sp.act, lr.block.attn, self.cfg
        if act is None:
            return P, 0
        with phase("rk.attn.active"):
            qa = act.take(qr)
            q = unweighted_rms_norm(attn.wq_b(qa).view(-1, attn.n_heads, cfg.head_dim), cfg.norm_eps)
            o, p = self._attend(attn, q, act, segs, attn.attn_sink, act.take(lr.hn) if attn.indexer else None, qa)
            if split:
                attn.project_relative(o.to(lr.hn.dtype), P[:act.n])
            else:
                P = act.put_(P, attn.project_relative(o.to(lr.hn.dtype)))
        return P, p * attn.n_heads

    def _global_attention(self, call: Call, lr: LayerRows, segs, qr, P, split: bool):
        """The other rows' Global heads (their slice of wq_b and of W_a), added onto their restored W_a,L O_L, into
        their rows of P (its last block in the split layout). Returns P and the triples attended."""
        rest, attn, cfg = lr.rest, lr.block.attn, self.cfg
        if rest is None:
            return P, 0
        M = lr.x.shape[0]
        pg = P[M - rest.n:] if split else None
        if lr.restore:                         # W_a,L O_L of these rows from their documents, in the rows' order
            with phase("rk.restore"):
                pg = self._restored_local(lr.i, lr.sp, call.docs, rest.n, attn, pg)
        with phase("rk.attn.global"):
            gm = self._global_heads(lr.x.device)
            Hg = gm.numel()
            wq = self._global_wq(attn, gm)
            qg = rest.take(qr)
            q = unweighted_rms_norm(torch.nn.functional.linear(qg.to(wq.dtype), wq).view(-1, Hg, cfg.head_dim),
                                    cfg.norm_eps)
            own = None
            if attn.kind == CSA and self.profile.global_picks == "artifact" and lr.restore:
                own = self._own_picks(call, lr.i, lr.sp)
            o, p = self._attend(attn, q, rest, segs, attn.attn_sink.index_select(0, gm),
                                rest.take(lr.hn) if attn.indexer and own is None else None, qg, own)
            # + W_a,G O_G in the same GEMM (onto the restored rows), or written into the split layout's rows
            pg = self._project_global(attn, o.to(lr.hn.dtype), pg, add=lr.restore)
        if not split:
            P = rest.put_(P, pg)
        return P, p * Hg

    def _active_ffn(self, call: Call, lr: LayerRows, x_attn) -> torch.Tensor:
        """In a fence, or with ffn_mode "skip": only active rows have an FFN; the others keep the attention
        sub-block's output (residual identity), or, in an artifact-KV fence, are not computed at all (their
        streams are left as they were)."""
        act, block, x = lr.sp.act, lr.block, lr.x
        keep = x if lr.fence and lr.sp.rest is not None else x_attn
        if act is None:
            return keep
        with phase("rk.ffn"):
            xa = act.take(x_attn)
            h2, post2, comb2 = block.hc_pre(xa, "ffn")
            hn2, ta = block.ffn_norm(h2), act.take(lr.tokens)
            if lr.fence:
                w, idx = block.ffn.gate(hn2, ta)
                y = block.ffn.routed(hn2, w, idx) + block.ffn.shared_experts(hn2).float()
                call.defer("moe_rows", act.n, self.cfg.n_activated_experts)
            else:
                y = self._moe_adaptive(call, block, hn2, ta)
            y = block.ffn.par.all_reduce(y).to(x.dtype)
            if keep is x or act.idx is None:
                mixed = block.hc_post(y, xa, post2, comb2)
                return act.put(keep, mixed) if keep is x else act.put_(keep, mixed)
            # the active rows' new streams written straight into their rows of this layer's own output
            return block.hc_post(y, xa, post2, comb2, out=keep, out_rows=act.idx)

    def _ffn(self, call: Call, lr: LayerRows, x_attn) -> torch.Tensor:
        """Every row's FFN: active rows MoE with adaptive fanout; the others per ffn_mode ("native": the full
        MoE, else the shared expert only)."""
        act, rest, block, tokens = lr.sp.act, lr.rest, lr.block, lr.tokens
        h2, post2, comb2 = block.hc_pre(x_attn, "ffn")
        hn2 = block.ffn_norm(h2)
        y = torch.zeros_like(hn2, dtype=torch.float32)
        if act is not None:
            y = act.put_(y, self._moe_adaptive(call, block, act.take(hn2), act.take(tokens)))
        if rest is not None:
            hr, tr = rest.take(hn2), rest.take(tokens)
            if self.profile.ffn_mode == "native":
                yr = block.ffn.routed(hr, *block.ffn.gate(hr, tr)) + block.ffn.shared_experts(hr).float()
                call.defer("moe_rows", rest.n, self.cfg.n_activated_experts)
            else:
                yr = block.ffn.shared_experts(hr).float()
                call.defer("moe_rows", rest.n, 0)
            y = rest.put_(y, yr)
        y = block.ffn.par.all_reduce(y).to(lr.x.dtype)
        return block.hc_post(y, x_attn, post2, comb2)

    def _attend(self, attn, q_raw, rows: Rows, segs, sink, h, qr, own_picks=None):
        """segment_attention in query chunks of about q_chunk x n_heads (row, head) pairs (bounded temporaries
        at long context; the Global heads' calls take proportionally more rows per chunk, and stacked calls over
        more than `policy.stacked_parts` segments proportionally fewer), each chunk's output written into its rows
        of one [T, H, D] result (no concatenation). h: the rows' hidden states for the online indexer (None: no
        indexer, or `own_picks` in its place)."""
        T, pairs, policy = q_raw.shape[0], 0, self.model.policy
        step = max(1, self.model.q_chunk * attn.n_heads // q_raw.shape[1])
        if not fused_call(q_raw, None, len(segs), policy, attn.kind) and len(segs) > policy.stacked_parts > 0:
            step = max(1, step * policy.stacked_parts // len(segs))
        res = q_raw.new_empty(q_raw.shape) if T > step or T == 0 else None
        for a in range(0, T, step):
            b = a + step
            o, p = segment_attention(attn, q_raw[a:b], rows.pos[a:b], segs, sink,
                                     (h[a:b], qr[a:b]) if h is not None else None, None,
                                     rows.pos_host[a:b], None if own_picks is None else own_picks[a:b],
                                     rows.trig.setdefault(a, {}), None if res is None else res[a:b],
                                     policy=self.model.policy)
            res = o if res is None else res
            pairs = pairs + p
        return res, pairs

    def _own_picks(self, call: Call, i, sp: Split) -> torch.Tensor:
        """[n_rest, k] entry ids: each non-active relocated row's own document's offline picks, in its own segment
        (its window still crosses the joins). Only relocated rows are non-active, in document order."""
        picks = [call.docs[j].layers[i].picks for j, _, _ in sp.rest_local]
        view = rows_view(picks)
        if view is not None:                 # every document's picks in one buffer, all of one width: one gather
            rows, firsts = view
            return rows.index_select(0, view_rows(sp, "picks", firsts, [(ids,) for _, ids, _ in sp.rest_local]))
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

    def _restored_local(self, i, sp: Split, docs, n_rest: int, attn, out=None) -> torch.Tensor:
        """[n_rest, G*R] the non-active rows' W_a,L O_L from their documents' artifacts, in the rows' order
        (gathered into `out`, given: contiguous, of W_a's dtype)."""
        w = attn.wo_a.weight
        local = [docs[j].layers[i].local_p for j, _, _ in sp.rest_local]
        scales = [docs[j].layers[i].local_s for j, _, _ in sp.rest_local]
        if any(s is not None for s in scales):
            return self._dequantized_local(sp, local, scales, n_rest, attn, out)
        view = rows_view(local)
        if view is not None and view[0].dtype == w.dtype and view[0].device == w.device:     # one gather
            rows, firsts = view
            ids = view_rows(sp, "local_p", firsts, [(ids,) for _, ids, _ in sp.rest_local])
            return torch.index_select(rows, 0, ids, out=out)
        return gather_rows([(t, ids, off) for t, (j, ids, off) in zip(local, sp.rest_local)], n_rest,
                           attn.n_groups * self.cfg.o_lora_rank, w.dtype, w.device, out)

    def _dequantized_local(self, sp: Split, local, scales, n_rest: int, attn, out=None) -> torch.Tensor:
        """`_restored_local` for FP8 artifacts (local_format="fp8"): the rows' codes and scales gathered and
        dequantized in one pass into W_a's dtype (`gather_dequant_rows`): one launch where every document's codes
        and scales each lie in one `rows_view` (a staged layer), else one per document."""
        w = attn.wo_a.weight
        if any(s is None for s in scales) or any(t.element_size() != 1 for t in local):
            raise ValueError("an FP8 Local contribution needs its codes and scales in every document")
        out = rows_out(out, n_rest, attn.n_groups * self.cfg.o_lora_rank, w.dtype, w.device, "the FP8 restore")
        ids = [(ids,) for _, ids, _ in sp.rest_local]
        cview, sview = rows_view(local), rows_view(scales)
        if cview is not None and sview is not None and cview[0].device == w.device:
            return gather_dequant_rows(cview[0], sview[0], view_rows(sp, "local_p", cview[1], ids),
                                       view_rows(sp, "local_s", sview[1], ids), out)
        for c, s, (_, ids, off) in zip(local, scales, sp.rest_local):
            if c.device != w.device:                # the rows only, then to the device
                r = ids.to(c.device)
                c, s = c.view(torch.uint8).index_select(0, r).to(w.device), s.index_select(0, r).to(w.device)
                ids = torch.arange(r.numel(), device=w.device)
            gather_dequant_rows(c, s, ids, ids, out[off:off + ids.numel()])
        return out

    def _moe_adaptive(self, call: Call, block, h, tokens) -> torch.Tensor:
        """Top-6 by the router, then k = smallest k >= min_experts whose normalized cumulative weight reaches
        tau; the k experts run with their original weights; the shared expert always runs."""
        prof = self.profile
        w, idx, k = adaptive_fanout(*block.ffn.gate(h, tokens), prof.tau, prof.min_experts)
        call.defer("moe_rows", h.shape[0], k.float().mean())
        return block.ffn.routed(h, w, idx) + block.ffn.shared_experts(h).float()


class DeepSeekPass(Pass):
    """One reuse prefill on DeepSeek-V4: [doc 1 (prefix, Delta=0), doc 2..k (relocated), question]. The computed
    rows are every row after the prefix (its state is its artifact in every layer)."""

    def __init__(self, ad: DeepSeekAdapter, docs: list[DocumentArtifact], question: list[int]):
        m, cfg, prof = ad.model, ad.cfg, ad.profile
        dev = m.embed.weight.device
        assert all(d.n % prof.align == 0 for d in docs), "artifacts are padded to the profile's alignment"
        super().__init__(prof, [d.n for d in docs], doc_offsets([d.n for d in docs]), len(question), cfg.n_layers,
                         dev)
        self.ad, self.docs = ad, docs
        prefix, reloc = docs[0], docs[1:]
        self.tokens = torch.tensor([t for d in reloc for t in d.tokens] + list(question), device=dev)
        self.positions = shared_arange(prefix.n, self.q_start + len(question), device=dev)
        self.ledger = Ledger.start(cfg, prof, n_prefix=prefix.n, n_reloc=self.n_reloc, n_new=len(question))
        self.call = Call(docs, self.ledger)
        self.state = RequestState({}, {}, {}, {}, {}, self.q_start, self.q_start + len(question))
        self.x = m.embed_streams(self.tokens)
        self.idx_score = torch.zeros(self.n_reloc, device=dev)
        self.split = None

    def _artifact_fence(self, i: int) -> bool:
        """A last fence taking non-active rows' KV from the artifacts (`last_fence_kv="artifact"`)."""
        prof, cfg = self.profile, self.ad.cfg
        return prof.last_fence_kv == "artifact" and i >= cfg.n_layers - prof.last_fences and i >= prof.first_fences

    def is_fence(self, i: int) -> bool:
        return self.profile.is_fence(self.ad.cfg, i) and not self._artifact_fence(i)

    def fence(self, i: int, signals: bool) -> None:
        ad, block = self.ad, self.ad.model.layers[i]
        lc = ad._prefix_cache(block, self.docs[0].layers[i])
        lc.capture = {} if i < self.profile.first_fences else None      # the first fences' latent and picks
        # the last layer, a fence, computes the last row's output only (as the recompute arm's does)
        out_rows = prefill_out_rows(ad.cfg, i, lc)
        with phase("rk.fence"):
            self.x = block(self.x, self.tokens, self.positions, lc, ad.model.q_chunk, out_rows=out_rows)
        cap, lc.capture = lc.capture, None
        self.state.fence_caches[i] = lc
        self.ledger.fence_layer(i, rows=len(self.tokens), total_rows=self.q_start + self.n_q, out_rows=out_rows)
        if signals:
            n = self.n_reloc
            self.deviation += fence_deviation(block, cap["latent"][:n], self.docs[1:], self.deltas[1:], i)
            if block.attn.kind == CSA and cap["topk"] is not None:
                self.idx_score = torch.maximum(self.idx_score, indexer_rows(cap["topk"], n, self.docs[0].n, self.n_q,
                                                                            block))

    def draft(self) -> torch.Tensor:
        """The question rows (after the first fences: the rows of `x` past `n_reloc`) drafted through this
        adapter's reusable layers."""
        n = self.n_reloc
        return draft_rows(self.ad, self.call, self.x[n:], self.tokens[n:], self.positions[n:], self.deltas)

    def activate(self, active: torch.Tensor) -> None:
        with phase("rk.select"):
            self.active = active.to(self.x.device)
            self.split = split_rows(self.active, self.positions, self.docs[1:], self.n_q, self.ad._geometries())
        self.ledger.set_active(self.split.act_reloc.shape[0])

    def reusable(self, i: int) -> None:
        self.x = self.ad._reusable_layer(self.call, i, self.ad.model.layers[i], self.x, self.tokens, self.deltas,
                                         self.split, self.state, fence=self._artifact_fence(i))

    def finish(self) -> ReuseResult:
        self.call.flush()
        logits = self.ad.model.logits(self.x[-1:])[0]
        act_pos = self.positions[:self.n_reloc][self.active] if self.active is not None else self.positions[:0]
        return ReuseResult(logits, self.ledger, act_pos, self.state)
