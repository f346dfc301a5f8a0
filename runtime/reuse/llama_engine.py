"""The reuse path for Llama-family models (Llama, Qwen2, SmolLM2): the same roles, fences, protected rows,
relocation by query rotation, LSE merge, certificate binding and ledger as the DeepSeek engine, on GQA.

Differences from DeepSeek-V4 that simplify it: K and V are separate per KV head, RoPE turns whole heads and
only K carries it (so relocation rotates the query and needs no output de-rotation), there is no sink, no
compressor and no MoE, and `W_o` is sliced directly by head channels: W_o O = W_o,L O_L + W_o,G O_G.
Roles are per KV group: in each group of `heads_per_kv` query heads the first `global_per_group` are Global.
Segments need no alignment (no compression blocks): the profile's `align` should be 1.

Profile values this path honours: fences, budget, `global_per_group`, `join_rows`, `recent_rows`, `ffn_mode`
("skip": non-active rows skip the FFN in reusable layers; "native": they run it; Llama has no shared expert)
and `last_fence_kv` ("recompute": the last fences recompute every row from its hidden state; "artifact":
non-active rows keep their artifact K/V there too, and only active and new rows are computed). Two consumer
knobs need no certificate because artifacts do not depend on them: `select` ("mixed": the shared controller;
"deviation": the budget goes to the rows that deviate most, CacheBlend-style; "attention": the budget goes to
the rows the question attends to most in a draft pass, `_draft_attention`) and `signal` (the deviation is
measured on K, or on K and V, in the first fences).

The draft is this family's stand-in for DeepSeek's native indexer (SPEC §5's I_top: rows the question picks).
After the first fences, the question rows alone run on through the reusable layers over every relocated row's
artifact K/V (what the naive arm sees); the attention probability their heads give each relocated row, summed
over those layers, rows and heads, ranks the rows. Its cost (question rows x reusable layers, a few percent of
the request at a 25% budget) is in the ledger.

Arms: `reuse` (this path), `naive` (every document row's K/V from its artifact, relocated, only the new rows
computed: what position-independent caches without recomputation do) and the caller's recompute arm."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.llama.model import KVCache, Llama, LayerCache, merge
from .certificate import FallbackReason, Verdict, token_hash
from .controller import choose_active, choose_by_deviation, choose_top
from .profile import ProfileError, ReuseProfile

SELECT_RULES = ("mixed", "deviation", "attention")
DEVIATION_SIGNALS = ("k", "kv")


@dataclass
class LlamaArtifact:
    tokens: list[int]
    k: list[torch.Tensor]                     # per layer [n, KV, D], RoPE at canonical positions 0..n-1
    v: list[torch.Tensor]                     # per layer [n, KV, D]
    local: list[torch.Tensor | None]          # per layer [n, d]: W_o,L O_L in reusable layers
    binding: dict = field(default_factory=dict)   # profile and token hash the artifact is certified for

    @property
    def n(self) -> int:
        return len(self.tokens)


def global_heads(model: Llama, prof: ReuseProfile) -> torch.Tensor:
    G = model.cfg.num_attention_heads // model.cfg.num_key_value_heads
    return torch.arange(model.cfg.num_attention_heads) % G < prof.global_per_group


@torch.inference_mode()
def produce_llama(model: Llama, tokens: list[int], prof: ReuseProfile, tokenizer_fp: str = "") -> LlamaArtifact:
    return produce_llama_many(model, tokens, [prof], tokenizer_fp)[0]


@torch.inference_mode()
def produce_llama_many(model: Llama, tokens: list[int], profs: list[ReuseProfile],
                       tokenizer_fp: str = "") -> list[LlamaArtifact]:
    """One document's artifact for each profile from one forward: K/V do not depend on the profile (the
    artifacts share those tensors), the Local projections only on the fences and Global heads per group."""
    n_layers = len(model.layers)
    dev = next(model.parameters()).device
    cache = model.new_cache()
    for lc in cache.layers:
        lc.capture = {}
    model(torch.tensor(tokens, device=dev), cache)
    caps = [lc.capture for lc in cache.layers]
    for lc in cache.layers:
        lc.capture = None
    ks = [c["k"].clone() for c in caps]
    vs = [c["v"].clone() for c in caps]
    local: dict[tuple[int, int], torch.Tensor] = {}                 # (layer, global_per_group) -> W_o,L O_L
    out = []
    for prof in profs:
        loc = (~global_heads(model, prof)).nonzero().flatten().to(dev)      # Local head ids (host mask: no sync)
        locals_ = []
        for i, (layer, cap) in enumerate(zip(model.layers, caps)):
            if i < prof.first_fences or i >= n_layers - prof.last_fences:
                locals_.append(None)
                continue
            key = (i, prof.global_per_group)
            if key not in local:
                local[key] = layer.self_attn.project(cap["o"].index_select(1, loc), heads=loc)
            locals_.append(local[key])
        out.append(LlamaArtifact(list(tokens), ks, vs, locals_,
                                 {"profile": prof.to_dict(), "token_hash": token_hash(tokens, tokenizer_fp)}))
    return out


@torch.inference_mode()
def produce_llama_packed(model: Llama, segments: list[list[int]], profs: list[ReuseProfile],
                         tokenizer_fp: str = "") -> list[list[LlamaArtifact]]:
    """`produce_llama_many` for every document of a request in one packed forward (`Llama.forward_packed`):
    per profile, the artifacts of the documents in order; equal to producing each alone up to rounding."""
    n_layers = len(model.layers)
    caps = model.forward_packed(segments)
    dev = caps[0][0].device
    bounds = [0]
    for t in segments:
        bounds.append(bounds[-1] + len(t))
    cut = lambda x: [x[a:b] for a, b in zip(bounds, bounds[1:])]            # noqa: E731
    ks = list(zip(*(cut(k) for k, _, _ in caps)))                          # per document, per layer
    vs = list(zip(*(cut(v) for _, v, _ in caps)))
    local: dict[tuple[int, int], list[torch.Tensor]] = {}
    out = []
    for prof in profs:
        loc = (~global_heads(model, prof)).nonzero().flatten().to(dev)
        per_layer = []
        for i, (layer, (_, _, o)) in enumerate(zip(model.layers, caps)):
            if i < prof.first_fences or i >= n_layers - prof.last_fences:
                per_layer.append([None] * len(segments))
                continue
            key = (i, prof.global_per_group)
            if key not in local:
                local[key] = cut(layer.self_attn.project(o.index_select(1, loc), heads=loc))
            per_layer.append(local[key])
        out.append([LlamaArtifact(list(t), list(ks[j]), list(vs[j]), [p[j] for p in per_layer],
                                  {"profile": prof.to_dict(), "token_hash": token_hash(t, tokenizer_fp)})
                    for j, t in enumerate(segments)])
    return out


@dataclass
class Relocated:
    """Every document row's artifact K/V at its request position (K rotated by its segment's offset; the
    prefix's offset is 0), per layer [q_start, KV, D]. The naive and reuse arms of one request share it: the
    artifacts' K/V do not depend on the profile."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    deltas: list[int]
    n: int                                    # q_start: rows before the question


@torch.inference_mode()
def relocate(model: Llama, docs: list[LlamaArtifact]) -> Relocated:
    deltas = _offsets(docs)
    pos = deltas[-1] + docs[-1].n
    dev = docs[0].k[0].device
    shift = torch.tensor([dl for d, dl in zip(docs, deltas) for _ in range(d.n)], device=dev)
    L = len(model.layers)
    k = torch.cat([torch.stack(d.k, dim=1) for d in docs])                # [q_start, L, KV, D]
    k = model.rotary.rotate(k, shift)
    v = torch.cat([torch.stack(d.v, dim=1) for d in docs])
    return Relocated([k[:, i] for i in range(L)], [v[:, i] for i in range(L)], deltas, pos)


@dataclass
class LlamaLedger:
    n_prefix: int
    n_reloc: int
    n_new: int
    n_layers: int
    n_heads: int
    active: int = 0
    head_rows: float = 0.0
    token_rows_skipped: float = 0.0
    flops: float = 0.0
    flops_recompute: float = 0.0

    def summary(self) -> dict:
        units = max(1, self.n_reloc * self.n_layers * self.n_heads)
        return {"rows": {"prefix": self.n_prefix, "relocated": self.n_reloc, "new": self.n_new,
                         "active": self.active},
                "head_row_saving": 1 - self.head_rows / units if self.n_reloc else 0.0,
                "token_row_saving": self.token_rows_skipped / max(1, self.n_reloc * self.n_layers),
                "flop_ratio": self.flops_recompute / self.flops if self.flops else float("inf")}


class LlamaReuseEngine:
    def __init__(self, model: Llama, prof: ReuseProfile, mode: str = "reuse", tokenizer_fp: str = "",
                 select: str = "mixed", signal: str = "k", split_heads: bool | None = None):
        assert mode in ("reuse", "naive"), mode
        c = model.cfg
        if prof.first_fences + prof.last_fences > len(model.layers):
            raise ValueError("fences exceed the model's layers")
        if prof.ffn_mode not in ("skip", "native"):
            raise ProfileError(f"ffn_mode={prof.ffn_mode!r}: a Llama layer has no shared expert (skip or native)")
        if not 1 <= prof.global_per_group <= c.heads_per_kv:
            raise ProfileError(f"global_per_group={prof.global_per_group} not in 1..{c.heads_per_kv}")
        if select not in SELECT_RULES or signal not in DEVIATION_SIGNALS:
            raise ValueError(f"select={select!r} (one of {SELECT_RULES}), signal={signal!r} (one of {DEVIATION_SIGNALS})")
        self.model, self.prof, self.mode, self.tokenizer_fp = model, prof, mode, tokenizer_fp
        self.select, self.signal = select, signal
        # prefill_cache's attention of reusable layers (`_reusable_attention`): split by heads off CUDA
        self.split_heads = split_heads if split_heads is not None else \
            next(model.parameters()).device.type != "cuda"
        self.gmask = global_heads(model, prof)
        self.n_layers = len(model.layers)
        # last fences that keep non-active rows' artifact K/V: every head of active and new rows is computed there
        self.full_layers = set(range(self.n_layers - prof.last_fences, self.n_layers)) \
            if mode == "reuse" and prof.last_fence_kv == "artifact" else set()
        self.d, self.H, self.KV, self.D = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.ffn = c.intermediate_size

    def verify(self, docs: list[LlamaArtifact]) -> Verdict:
        """Each artifact must be certified for this profile and its own tokens."""
        for d in docs:
            if d.binding.get("profile") != self.prof.to_dict():
                return Verdict.reject(FallbackReason.PROFILE_MISMATCH, "artifact built for another profile")
            if d.binding.get("token_hash") != token_hash(d.tokens, self.tokenizer_fp):
                return Verdict.reject(FallbackReason.TOKEN_MISMATCH, "artifact tokens do not match its certificate")
        return Verdict.accept()

    def _fence(self, i: int) -> bool:
        """A layer that recomputes every row from its hidden state."""
        return self.mode == "reuse" and (i < self.prof.first_fences or (
            i >= self.n_layers - self.prof.last_fences and i not in self.full_layers))

    # --------------------------------------------------------------------------------------------
    def _flops_row(self, heads: int, keys: float, mlp: bool, qkv_heads: int | None = None) -> float:
        d, D = self.d, self.D
        qh = heads if qkv_heads is None else qkv_heads
        f = 2 * d * D * qh + 2 * d * D * 2 * self.KV * (qkv_heads is None) + 2 * heads * D * d + 4 * heads * D * keys
        return f + (6 * d * self.ffn if mlp else 0)

    @torch.inference_mode()
    def prefill(self, docs: list[LlamaArtifact], question: list[int]):
        m, prof = self.model, self.prof
        dev = next(m.parameters()).device
        deltas = _offsets(docs)
        q_start = deltas[-1] + docs[-1].n
        n_reloc = q_start - docs[0].n
        reloc = docs[1:]
        led = LlamaLedger(docs[0].n, n_reloc, len(question), self.n_layers, self.H)
        T_all = q_start + len(question)
        # recompute arm: every row, every layer; a row at position t attends t+1 keys
        led.flops_recompute = self.n_layers * (T_all * self._flops_row(self.H, 0, True)
                                               + 4 * self.H * self.D * T_all * (T_all + 1) / 2)
        computed = list(range(docs[0].n, T_all)) if self.mode == "reuse" else list(range(q_start, T_all))
        tok_all = torch.tensor([t for d in docs for t in d.tokens] + list(question), device=dev)
        positions = torch.tensor(computed, device=dev)
        x = m.embed(tok_all[positions])
        n_rc = n_reloc if self.mode == "reuse" else 0            # relocated rows this arm computes
        deviation = torch.zeros(n_reloc, device=dev)
        active = torch.zeros(n_reloc, dtype=torch.bool, device=dev) if self.mode == "naive" else None
        state = {"fence": {}, "segs": {}, "new": {}, "delta_q": q_start, "pos": T_all}
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            if self._fence(i):
                x, lc, k_req, v_req = _fence_layer(layer, x, positions, docs[0], i)
                state["fence"][i] = lc
                led.head_rows += n_reloc * self.H
                led.flops += x.shape[0] * self._flops_row(self.H, positions.float().mean().item() + 1, True)
                if i < prof.first_fences and n_reloc:
                    a = 0
                    for d, dl in zip(reloc, deltas[1:]):
                        moved = attn.rotary.rotate(d.k[i], torch.full((d.n,), dl, device=dev))
                        got = k_req[a:a + d.n]
                        deviation[a:a + d.n] += _rel_dev(got, moved)
                        if self.signal == "kv":                     # V carries no RoPE: compared as stored
                            deviation[a:a + d.n] += _rel_dev(v_req[a:a + d.n], d.v[i])
                        a += d.n
                continue
            if active is None:
                active = self._choose(deviation.cpu(), x, positions,
                                      relocate(m, docs) if n_reloc and self.select == "attention" else None,
                                      docs, q_start, len(question), led).to(dev)
                led.active = int(active.sum())
            x = self._layer(i, layer, x, positions, docs, deltas, active, n_rc, state, led)
        logits = m.logits(x[-1:])[0]
        return logits, state, led

    @torch.inference_mode()
    def prefill_cache(self, docs: list[LlamaArtifact], question: list[int], reloc: Relocated | None = None,
                      active: torch.Tensor | None = None):
        """`prefill` on the request's own KV cache: every layer's K/V held at request positions (relocated rows'
        artifact K rotated once, `relocate`), active and new rows' K/V computed at their request positions and
        written over them, and each layer's rows attending once over the whole cache with the causal mask
        (RoPE: R(a) R(b) = R(a+b), so this equals the per-segment attention and LSE merge of `prefill` up to
        rounding). The naive arm is the model's own prefill of the question on the relocated cache.
        Returns (logits of the last row [V], the KVCache that plain decoding continues, ledger); the same
        ledger as `prefill`; two host syncs (the deviations to the host controller, the mean key count) instead
        of several per layer. `active` (a bool mask over the relocated rows, reuse mode) replaces the select
        rule's choice: for studies that compare a rule with an oracle (bench/row_selection.py)."""
        m, prof = self.model, self.prof
        dev = next(m.parameters()).device
        reloc = reloc if reloc is not None else relocate(m, docs)
        q_start, n0, nq = reloc.n, docs[0].n, len(question)
        n_reloc, T_all = q_start - n0, q_start + nq
        led = LlamaLedger(n0, n_reloc, nq, self.n_layers, self.H)
        led.flops_recompute = self.n_layers * (T_all * self._flops_row(self.H, 0, True)
                                               + 4 * self.H * self.D * T_all * (T_all + 1) / 2)
        if active is not None and (self.mode == "naive" or active.shape != (n_reloc,)):
            raise ValueError(f"an active mask of shape {tuple(active.shape)}: the reuse arm takes one bool per "
                             f"relocated row ({n_reloc}); the naive arm takes none")
        Hg = int(self.gmask.sum())
        layers = []
        for i in range(self.n_layers):                       # the relocated rows, room for the new ones
            k = reloc.k[i].new_empty((T_all,) + reloc.k[i].shape[1:])
            v = reloc.v[i].new_empty((T_all,) + reloc.v[i].shape[1:])
            k[:q_start], v[:q_start] = reloc.k[i], reloc.v[i]
            layers.append(LayerCache(k, v, q_start))
        cache = KVCache(layers, pos=q_start)
        if self.mode == "naive":
            logits = m(torch.tensor(list(question), device=dev), cache)
            keys = torch.arange(q_start, T_all, device=dev).float().mean().item() + 1
            for _ in range(self.n_layers):
                led.token_rows_skipped += n_reloc
                led.flops += nq * self._flops_row(self.H, keys, True)
            return logits, cache, led

        tokens = torch.tensor([t for d in docs[1:] for t in d.tokens] + list(question), device=dev)
        positions = torch.arange(n0, T_all, device=dev)
        keys = positions.float().mean().item() + 1
        k_pos = torch.arange(T_all, device=dev)
        x = m.embed(tokens)
        deviation = torch.zeros(n_reloc, device=dev)
        given, active = active, None
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            if self._fence(i):
                x, cache.layers[i], k_req, v_req = _fence_layer(layer, x, positions, docs[0], i)
                led.head_rows += n_reloc * self.H
                led.flops += x.shape[0] * self._flops_row(self.H, keys, True)
                if i < prof.first_fences and n_reloc:
                    deviation += _rel_dev(k_req[:n_reloc], reloc.k[i][n0:])
                    if self.signal == "kv":                     # V carries no RoPE: compared as stored
                        deviation += _rel_dev(v_req[:n_reloc], reloc.v[i][n0:])
                continue
            if active is None:
                # the controller ranks and fills classes row by row: on a host copy (one transfer), not the device
                active = self._choose(deviation.cpu(), x, positions, reloc, docs, q_start, nq, led) \
                    if given is None else given.cpu().bool()
                computed = torch.cat([active, torch.ones(nq, dtype=torch.bool)])              # rows of x
                sel = computed.nonzero().flatten().to(dev)
                computed, active = computed.to(dev), active.to(dev)
                led.active = n_act = sel.shape[0] - nq
                # per row and head: every head of a computed row, the Global heads of the others
                heads = (computed[:, None] | self.gmask.to(dev)[None, :]).to(x.dtype)[:, :, None]
                rest = (~active).to(x.dtype)[:, None]
            full = i in self.full_layers
            if full and x.shape[0] != sel.shape[0]:
                # non-active rows are read by no later layer (every later layer is full): drop them for good
                x, positions = x[sel], positions[sel]
                sel = torch.arange(x.shape[0], device=dev)
            lc = cache.layers[i]
            q, k, v = attn.qkv(layer.input_layernorm(x), positions)
            lc.k.index_copy_(0, positions[sel], k[sel].to(lc.k.dtype))
            lc.v.index_copy_(0, positions[sel], v[sel].to(lc.v.dtype))
            lc.n = T_all
            if full:
                o, _ = attn.attend(q, lc.k, lc.v, positions, k_pos)
                h2 = x + attn.project(o.to(x.dtype))
            else:
                # non-active rows: W_o,G O_G + bias + the artifact's W_o,L O_L (their Local heads' outputs zeroed)
                h2 = x + attn.project(self._reusable_attention(attn, q, lc, positions, k_pos, sel, heads))
                if n_reloc:
                    h2[:n_reloc] += torch.cat([d.local[i] for d in docs[1:]]).to(x.dtype) * rest
            if self.prof.ffn_mode == "native" or full:
                h2 = h2 + layer.mlp(layer.post_attention_layernorm(h2))
            else:
                h2.index_add_(0, sel, layer.mlp(layer.post_attention_layernorm(h2[sel])))
            x = h2
            n_rest = 0 if full else n_reloc - n_act
            led.head_rows += n_act * self.H + (led.n_reloc - n_act) * (Hg if not full else 0)
            led.token_rows_skipped += led.n_reloc - n_act
            led.flops += (n_act + nq) * self._flops_row(self.H, keys, True) + \
                n_rest * self._flops_row(Hg, keys, self.prof.ffn_mode == "native" and not full, qkv_heads=Hg)
        cache.pos = T_all
        return m.logits(x[-1:])[0], cache, led

    def _choose(self, dev_h: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, reloc: Relocated | None,
                docs: list[LlamaArtifact], q_start: int, nq: int, led: LlamaLedger) -> torch.Tensor:
        """The active relocated rows (a host bool mask) by this engine's `select` rule. `x` holds the computed
        rows' hidden states after the first fences (relocated rows, then the question rows) at `positions`."""
        if self.select == "deviation":
            return choose_by_deviation(self.prof, dev_h)
        if self.select == "attention":
            score = self._draft_attention(x[x.shape[0] - nq:], positions[positions.shape[0] - nq:], reloc,
                                          docs[0].n, q_start, led) if dev_h.numel() else dev_h
            return choose_top(self.prof, score.cpu())
        return choose_active(self.prof, dev_h, torch.zeros_like(dev_h), [d.n for d in docs[1:]],
                             _offsets(docs)[1:], q_start, nq)

    def _draft_attention(self, xq: torch.Tensor, pos_q: torch.Tensor, reloc: Relocated, n0: int, q_start: int,
                         led: LlamaLedger) -> torch.Tensor:
        """The question rows alone, from their exact hidden states after the first fences, through every
        reusable layer over the relocated artifact K/V of all document rows (the naive arm's view) and their own
        K/V, with the model's own layer math. Returns, per relocated row [n_reloc] float32, the attention
        probability the question rows' heads give it, summed over those layers, rows and heads. Its FLOPs are
        added to the ledger (every head of the question rows in each drafted layer)."""
        m = self.model
        T = q_start + xq.shape[0]
        k_pos = torch.arange(T, device=xq.device)
        score = torch.zeros(q_start - n0, dtype=torch.float32, device=xq.device)
        layers = range(self.prof.first_fences, self.n_layers - self.prof.last_fences)
        for i in layers:
            layer = m.layers[i]
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(xq), pos_q)
            keys = torch.cat([reloc.k[i], k.to(reloc.k[i].dtype)])
            o, lse = attn.attend(q, keys, torch.cat([reloc.v[i], v.to(reloc.v[i].dtype)]), pos_q, k_pos)
            score += _attention_mass(q, keys[n0:q_start], lse, attn.scale)
            h = xq + attn.project(o.to(xq.dtype))
            xq = h + layer.mlp(layer.post_attention_layernorm(h))
        led.flops += len(layers) * xq.shape[0] * self._flops_row(self.H, (q_start + T + 1) / 2, True)
        return score

    def _reusable_attention(self, attn, q, lc, positions, k_pos, sel, heads) -> torch.Tensor:
        """Per-head outputs [R,H,D] of a reusable layer's rows: every head of the computed rows `sel`, the
        Global heads of the others, zeros in their Local heads. `split_heads`: two attention calls, one for
        every row's Global heads and one for the computed rows' Local heads (no score is computed that is not
        used: the cheaper path where arithmetic costs more than launches, the CPU); otherwise one call over
        every head of every row, the unused outputs zeroed (fewer launches: the GPU)."""
        if not self.split_heads:
            o, _ = attn.attend(q, lc.k, lc.v, positions, k_pos)
            return (o * heads).to(q.dtype)
        R, H, D = q.shape
        KV = self.KV
        g = self.prof.global_per_group                          # the first g heads of each KV group are Global
        qg = q.view(R, KV, H // KV, D)
        o = q.new_zeros(R, KV, H // KV, D)
        o[:, :, :g] = attn.attend(qg[:, :, :g].reshape(R, KV * g, D), lc.k, lc.v, positions, k_pos)[0] \
            .view(R, KV, g, D)
        if g < H // KV:
            loc = attn.attend(qg[sel, :, g:].reshape(sel.shape[0], -1, D), lc.k, lc.v, positions[sel], k_pos)[0]
            o[sel, :, g:] = loc.view(sel.shape[0], KV, -1, D)
        return o.view(R, H, D)

    def _segments(self, i, attn, h, docs, deltas, active, n_rc, dev):
        """Per segment (delta, k canonical, v): prefix and relocated from their artifacts, with active rows'
        recomputed K/V overlaid on copies."""
        segs = [(0, docs[0].k[i], docs[0].v[i])]
        a = 0
        for d, dl in zip(docs[1:], deltas[1:]):
            k, v = d.k[i], d.v[i]
            if n_rc and active[a:a + d.n].any():
                act = active[a:a + d.n]
                cpos = torch.arange(d.n, device=dev)[act]
                _, k_new, v_new = attn.qkv(h[a:a + d.n][act], cpos)
                k, v = k.clone(), v.clone()
                k[act], v[act] = k_new.to(k.dtype), v_new.to(v.dtype)
            segs.append((dl, k, v))
            a += d.n
        return segs

    def _attend(self, attn, q, qpos, segs):
        parts = []
        for dl, k, v in segs:
            qr = attn.rotary.rotate(q, torch.full((q.shape[0],), -dl, device=q.device))
            parts.append(attn.attend(qr, k, v, qpos - dl, torch.arange(k.shape[0], device=q.device)))
        return merge(parts)[0]

    def _layer(self, i, layer, x, positions, docs, deltas, active, n_rc, state, led):
        attn, dev = layer.self_attn, x.device
        h = layer.input_layernorm(x)
        if i not in state["segs"]:
            state["segs"][i] = self._segments(i, attn, h, docs, deltas, active, n_rc, dev)
        segs = state["segs"][i]
        nrows = slice(n_rc, x.shape[0])
        new_pos = positions[nrows] - state["delta_q"]
        q_new, k_new, v_new = attn.qkv(h[nrows], positions[nrows])
        k_new = attn.rotary.rotate(k_new, torch.full((k_new.shape[0],), -state["delta_q"], device=dev))
        nk, nv = state["new"].get(i, (k_new[:0], v_new[:0]))
        nk, nv = torch.cat([nk, k_new]), torch.cat([nv, v_new])
        state["new"][i] = (nk, nv)
        all_segs = segs + [(state["delta_q"], nk, nv)]
        row_active = torch.cat([active[:n_rc], torch.ones(x.shape[0] - n_rc, dtype=torch.bool, device=dev)])
        out = torch.zeros_like(x)
        if row_active.any():
            rows = torch.nonzero(row_active).flatten()
            q, _, _ = attn.qkv(h[rows], positions[rows])
            o = self._attend(attn, q, positions[rows], all_segs)
            out[rows] = attn.project(o.to(x.dtype)).to(out.dtype)
        full = i in self.full_layers
        # in a full layer non-active rows are not computed: their K/V are the artifact's, their hidden states
        # are read by no later layer (every later layer is full too)
        rest = torch.nonzero(~row_active).flatten() if not full else row_active.nonzero()[:0, 0]
        if rest.numel():
            gm = self.gmask.to(dev)
            q, _, _ = attn.qkv(h[rest], positions[rest])          # (the Global slice is what counts; see ledger)
            o = self._attend(attn, q[:, gm], positions[rest], all_segs)
            y = attn.project(o.to(x.dtype), heads=gm)
            if attn.o_proj.bias is not None:
                y = y + attn.o_proj.bias
            local = torch.cat([d.local[i] for d in docs[1:]])
            out[rest] = (y + local[rest].to(y.dtype)).to(out.dtype)
        h2 = x + out
        rest_ffn = self.prof.ffn_mode == "native" and not full
        mlp_rows = torch.ones_like(row_active) if rest_ffn else row_active
        if mlp_rows.any():
            rows = torch.nonzero(mlp_rows).flatten()
            h2[rows] = h2[rows] + layer.mlp(layer.post_attention_layernorm(h2[rows]))
        n_act = int(row_active[:n_rc].sum())
        Hg = int(self.gmask.sum())
        led.head_rows += n_act * self.H + (led.n_reloc - n_act) * (Hg if n_rc and not full else 0)
        led.token_rows_skipped += led.n_reloc - n_act
        keys = positions.float().mean().item() + 1
        led.flops += int(row_active.sum()) * self._flops_row(self.H, keys, True) + \
            int(rest.numel()) * self._flops_row(Hg, keys, rest_ffn, qkv_heads=Hg)
        return h2

    @torch.inference_mode()
    def decode(self, state, token: int) -> torch.Tensor:
        m = self.model
        dev = next(m.parameters()).device
        pos = torch.tensor([state["pos"]], device=dev)
        x = m.embed(torch.tensor([token], device=dev))
        none = torch.zeros(0, dtype=torch.bool, device=dev)
        dummy = LlamaLedger(0, 0, 0, self.n_layers, self.H)
        for i, layer in enumerate(m.layers):
            if i in state["fence"]:
                x = layer(x, pos, state["fence"][i])
            else:
                x = self._layer(i, layer, x, pos, None, None, none, 0, state, dummy)
        state["pos"] += 1
        return m.logits(x)[0]

    @torch.inference_mode()
    def assemble(self, state) -> KVCache:
        """The request's KV cache after prefill as plain decoding reads it: per layer, every segment's K/V (the
        artifact's with active rows overlaid, and the new rows') with K rotated from canonical to request
        positions (RoPE: R(a) R(b) = R(a+b)); fence layers' caches as they are. Decoding on it with the model's
        own forward equals `decode` up to rounding, in ~1/10 of the kernel launches (one attention per layer
        instead of one per segment and a merge)."""
        m = self.model
        layers = []
        for i, layer in enumerate(m.layers):
            if i in state["fence"]:
                layers.append(state["fence"][i])
                continue
            rot = layer.self_attn.rotary
            segs = state["segs"][i] + [(state["delta_q"],) + state["new"][i]]
            lc = LayerCache()
            lc.append(torch.cat([rot.rotate(k, torch.full((k.shape[0],), dl, device=k.device)) for dl, k, _ in segs]),
                      torch.cat([v for _, _, v in segs]))
            assert lc.n == state["pos"], f"layer {i}: {lc.n} rows assembled, the request has {state['pos']}"
            layers.append(lc)
        return KVCache(layers, pos=state["pos"])

    def generate(self, docs, question, max_new_tokens: int, stop: set[int], reference: bool = False):
        """`prefill_cache`, then greedy decoding with the model's own forward on that cache (`reference`:
        per-segment `prefill` and `decode`)."""
        if reference:
            logits, state, led = self.prefill(docs, question)
            step = lambda t: self.decode(state, t)                                   # noqa: E731
        else:
            logits, cache, led = self.prefill_cache(docs, question)
            step = lambda t: self.model(torch.tensor([t], device=logits.device), cache)    # noqa: E731
        first = logits
        out = []
        for _ in range(max_new_tokens):
            nxt = int(logits.argmax())
            if nxt in stop:
                break
            out.append(nxt)
            logits = step(nxt)
        return out, first, led


def _fence_layer(layer, x: torch.Tensor, positions: torch.Tensor, prefix: LlamaArtifact, i: int):
    """A fence layer: the model's own layer over every computed row after the prefix's K/V. Returns the new
    hidden rows, the layer's cache (prefix and computed rows at request positions) and the rows' K and V."""
    lc = LayerCache()
    lc.append(prefix.k[i], prefix.v[i])
    lc.capture = {}
    x = layer(x, positions, lc)
    k, v, lc.capture = lc.capture["k"], lc.capture["v"], None
    return x, lc, k, v


def _offsets(docs: list[LlamaArtifact]) -> list[int]:
    """Each segment's request offset: documents back to back from 0."""
    out, pos = [], 0
    for d in docs:
        out.append(pos)
        pos += d.n
    return out


def _attention_mass(q: torch.Tensor, keys: torch.Tensor, lse: torch.Tensor, scale: float) -> torch.Tensor:
    """Per key row [S] float32: the attention probability exp(q.k x scale - lse) summed over query rows and
    heads, for queries q [T,H,D] (query head h reads KV head h // G) whose softmax normalizers are lse [T,H]
    (natural log) and keys [S,KV,D] that every query sees."""
    T, H, D = q.shape
    KV = keys.shape[1]
    s = torch.einsum("tkgd,skd->tkgs", q.view(T, KV, H // KV, D).float(), keys.float()) * scale
    return torch.exp(s - lse.view(T, KV, H // KV, 1)).sum((0, 1, 2))


def _rel_dev(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row ||got - ref|| / ||ref|| over all KV heads and channels, float32."""
    g, r = got.float().flatten(1), ref.float().flatten(1)
    return (g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)
