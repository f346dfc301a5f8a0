"""The reuse path for Llama-family models (Llama, Qwen2, SmolLM2): the same roles, fences, protected rows,
relocation by query rotation, LSE merge, certificate binding, controller and ledger namespaces as the DeepSeek
engine, on GQA. This file is the request loop; what is particular to the family (its artifacts, producer,
relocation, per-layer math and FLOP model) is its adapter beside the model, `runtime/llama/adapter.py`.

Profile values this path honours: fences, budget, `global_per_group`, `join_rows`, `recent_rows`, `ffn_mode`
("skip": non-active rows skip the FFN in reusable layers; "native": they run it; Llama has no shared expert),
`last_fence_kv` ("recompute": the last fences recompute every row from its hidden state; "artifact":
non-active rows keep their artifact K/V there too, and only active and new rows are computed), `select` (the
shared controller's rule, `controller.choose`; "attention" drafts the question over the artifacts,
`LlamaAdapter.draft_attention`, its cost in the ledger) and `signal` (the deviation measured on K, or on K and V,
in the first fences).

Arms: `reuse` (this path), `naive` (every document row's K/V from its artifact, relocated, only the new rows
computed: what position-independent caches without recomputation do) and the caller's recompute arm."""
from __future__ import annotations

import torch

from runtime.llama.adapter import LlamaAdapter, LlamaArtifact, Relocated, expectations, relocate
from runtime.llama.model import KVCache, Llama, LayerCache
from .certificate import Verdict, token_hash, validate
from .controller import check_active, choose, doc_offsets
from .greedy import greedy
from .profile import ProfileError, ReuseProfile


class LlamaReuseEngine:
    def __init__(self, model: Llama, prof: ReuseProfile, mode: str = "reuse", tokenizer_fp: str = "",
                 split_heads: bool | None = None, fingerprint: str = ""):
        assert mode in ("reuse", "naive"), mode
        c = model.cfg
        if prof.first_fences + prof.last_fences > len(model.layers):
            raise ValueError("fences exceed the model's layers")
        if prof.ffn_mode not in ("skip", "native"):
            raise ProfileError(f"ffn_mode={prof.ffn_mode!r}: a Llama layer has no shared expert (skip or native)")
        if not 1 <= prof.global_per_group <= c.heads_per_kv:
            raise ProfileError(f"global_per_group={prof.global_per_group} not in 1..{c.heads_per_kv}")
        self.model, self.prof, self.mode = model, prof, mode
        # what artifacts are bound to besides the profile and tokens (`certify`): "" where the caller has none
        self.tokenizer_fp, self.fingerprint = tokenizer_fp, fingerprint
        self.n_layers = len(model.layers)
        # last fences that keep non-active rows' artifact K/V: every head of active and new rows is computed there
        full_layers = set(range(self.n_layers - prof.last_fences, self.n_layers)) \
            if mode == "reuse" and prof.last_fence_kv == "artifact" else set()
        # prefill_cache's attention of reusable layers (`reusable_attention`): split by heads off CUDA
        split = split_heads if split_heads is not None else next(model.parameters()).device.type != "cuda"
        self.adapter = LlamaAdapter(model, prof, full_layers, split)
        self.H = c.num_attention_heads

    def verify(self, docs: list[LlamaArtifact]) -> Verdict:
        """Each artifact's certificate, checked by the shared `certificate.validate` (as the DeepSeek worker's are):
        this model's fingerprint, dtype and producer, its own tokens, this profile, every layer; the first reject."""
        expect = expectations(self.model, self.fingerprint)
        for d in docs:
            v = validate(d.cert, **expect, tokens_hash=token_hash(d.tokens, self.tokenizer_fp), profile=self.prof,
                         current_generation=0)
            if not v.ok:
                return v
        return Verdict.accept()

    def _fence(self, i: int) -> bool:
        """A layer that recomputes every row from its hidden state."""
        return self.mode == "reuse" and (i < self.prof.first_fences or (
            i >= self.n_layers - self.prof.last_fences and i not in self.adapter.full_layers))

    # --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, docs: list[LlamaArtifact], question: list[int], active: torch.Tensor | None = None):
        """The reference path: per-segment attention with queries rotated per segment and an LSE merge. `active`
        as in `prefill_cache`."""
        m, prof, ad = self.model, self.prof, self.adapter
        dev = next(m.parameters()).device
        deltas = doc_offsets([d.n for d in docs])
        q_start = deltas[-1] + docs[-1].n
        n_reloc = q_start - docs[0].n
        reloc = docs[1:]
        led = ad.ledger(docs[0].n, n_reloc, len(question))
        T_all = q_start + len(question)
        led.recompute(T_all)
        self._check_given(active, n_reloc)
        computed = list(range(docs[0].n, T_all)) if self.mode == "reuse" else list(range(q_start, T_all))
        tok_all = torch.tensor([t for d in docs for t in d.tokens] + list(question), device=dev)
        positions = torch.tensor(computed, device=dev)
        x = m.embed(tok_all[positions])
        n_rc = n_reloc if self.mode == "reuse" else 0            # relocated rows this arm computes
        deviation = torch.zeros(n_reloc, device=dev)
        given, active = active, torch.zeros(n_reloc, dtype=torch.bool, device=dev) if self.mode == "naive" else None
        state = {"fence": {}, "segs": {}, "new": {}, "delta_q": q_start, "pos": T_all}
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            if self._fence(i):
                x, lc, k_req, v_req = ad.fence(layer, x, positions, docs[0], i)
                state["fence"][i] = lc
                led.fence(x.shape[0], positions.float().mean().item() + 1)
                if i < prof.first_fences and n_reloc:
                    a = 0
                    for d, dl in zip(reloc, deltas[1:]):
                        moved = attn.rotary.rotate(d.k[i], torch.full((d.n,), dl, device=dev))
                        deviation[a:a + d.n] += ad.deviation(k_req[a:a + d.n], v_req[a:a + d.n], moved, d.v[i])
                        a += d.n
                continue
            if active is None:
                active = self._choose(given, deviation, x, positions, lambda: relocate(m, docs), docs, q_start,
                                      len(question), led).to(dev)
            x = ad.layer(i, layer, x, positions, docs, deltas, active, n_rc, state, led)
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
        ledger as `prefill`, whose `active_rows` are the relocated rows the rule chose; two host syncs (the
        deviations to the host controller, the mean key count) instead of several per layer. `active` (a bool
        mask over the relocated rows, reuse mode) replaces the select rule's choice: for studies that compare a
        rule with an oracle (bench/row_selection.py) and tests that run two paths on the same rows."""
        m, prof, ad = self.model, self.prof, self.adapter
        dev = next(m.parameters()).device
        reloc = reloc if reloc is not None else relocate(m, docs)
        q_start, n0, nq = reloc.n, docs[0].n, len(question)
        n_reloc, T_all = q_start - n0, q_start + nq
        led = ad.ledger(n0, n_reloc, nq)
        led.recompute(T_all)
        self._check_given(active, n_reloc)
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
                led.reusable(0, nq, 0, 0, keys, False)
            return logits, cache, led

        tokens = torch.tensor([t for d in docs[1:] for t in d.tokens] + list(question), device=dev)
        positions = torch.arange(n0, T_all, device=dev)
        keys = positions.float().mean().item() + 1
        k_pos = torch.arange(T_all, device=dev)
        x = m.embed(tokens)
        deviation = torch.zeros(n_reloc, device=dev)
        given, active = active, None
        Hg = int(ad.gmask.sum())
        for i, layer in enumerate(m.layers):
            if self._fence(i):
                x, cache.layers[i], k_req, v_req = ad.fence(layer, x, positions, docs[0], i)
                led.fence(x.shape[0], keys)
                if i < prof.first_fences and n_reloc:
                    deviation += ad.deviation(k_req[:n_reloc], v_req[:n_reloc], reloc.k[i][n0:], reloc.v[i][n0:])
                continue
            if active is None:
                # the controller ranks and fills classes row by row: on a host copy (one transfer), not the device
                active = self._choose(given, deviation, x, positions, lambda: reloc, docs, q_start, nq, led)
                computed = torch.cat([active, torch.ones(nq, dtype=torch.bool)])              # rows of x
                sel = computed.nonzero().flatten().to(dev)
                computed, active = computed.to(dev), active.to(dev)
                n_act = sel.shape[0] - nq
                # per row and head: every head of a computed row, the Global heads of the others
                heads = (computed[:, None] | ad.gmask.to(dev)[None, :]).to(x.dtype)[:, :, None]
                rest = (~active).to(x.dtype)[:, None]
            full = i in ad.full_layers
            x, positions, sel = ad.cache_layer(i, layer, x, positions, sel, heads, rest, docs, cache.layers[i], T_all,
                                               k_pos)
            led.reusable(n_act, nq, 0 if full else n_reloc - n_act, 0 if full else Hg, keys,
                         prof.ffn_mode == "native" and not full)
        cache.pos = T_all
        return m.logits(x[-1:])[0], cache, led

    def _check_given(self, active: torch.Tensor | None, n_reloc: int) -> None:
        if active is not None and self.mode == "naive":
            raise ValueError("an active mask was given to the naive arm: the naive arm takes none")
        if active is not None:
            check_active(active.cpu(), n_reloc)

    def _choose(self, given, deviation: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, reloc,
                docs: list[LlamaArtifact], q_start: int, nq: int, led) -> torch.Tensor:
        """The active relocated rows (a host bool mask): the caller's `given` mask, else the profile's `select`
        rule (`controller.choose`). `x` holds the computed rows' hidden states after the first fences (relocated
        rows, then the question rows) at `positions`; `reloc()` gives the relocated artifact K/V the draft reads.
        Recorded in the ledger (`active`, `active_rows`)."""
        if given is not None:
            active = given.cpu()
        else:
            def draft():
                return self.adapter.draft_attention(x[x.shape[0] - nq:], positions[positions.shape[0] - nq:], reloc(),
                                                    docs[0].n, q_start, led).cpu()
            active = choose(self.prof, deviation.cpu(), None, draft, [d.n for d in docs[1:]],
                            doc_offsets([d.n for d in docs])[1:], q_start, nq)
        led.active = int(active.sum())
        led.active_rows = tuple(active.nonzero().flatten().tolist())
        return active

    @torch.inference_mode()
    def decode(self, state, token: int) -> torch.Tensor:
        m = self.model
        dev = next(m.parameters()).device
        pos = torch.tensor([state["pos"]], device=dev)
        x = m.embed(torch.tensor([token], device=dev))
        none = torch.zeros(0, dtype=torch.bool, device=dev)
        uncounted = self.adapter.ledger(0, 0, 0)
        for i, layer in enumerate(m.layers):
            if i in state["fence"]:
                x = layer(x, pos, state["fence"][i])
            else:
                x = self.adapter.layer(i, layer, x, pos, None, None, none, 0, state, uncounted)
        state["pos"] += 1
        return m.logits(x)[0]

    @torch.inference_mode()
    def assemble(self, state) -> KVCache:
        return self.adapter.assemble(state)

    def generate(self, docs, question, max_new_tokens: int, stop: set[int], reference: bool = False):
        """`prefill_cache`, then greedy decoding with the model's own forward on that cache (`reference`:
        per-segment `prefill` and `decode`)."""
        if reference:
            logits, state, led = self.prefill(docs, question)
            step = lambda t: self.decode(state, t)                                   # noqa: E731
        else:
            logits, cache, led = self.prefill_cache(docs, question)
            step = lambda t: self.model(torch.tensor([t], device=logits.device), cache)    # noqa: E731
        return greedy(logits, step, max_new_tokens, stop), logits, led
