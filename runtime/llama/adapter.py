"""The Llama family's side of the reuse path (Llama, Qwen2, SmolLM2): the per-layer math and passes the engine
(`runtime/reuse/engine.py`) runs under the shared request loop, controller, ledger and certificate; its artifacts,
their producers and relocation are `artifacts.py`.

What differs from DeepSeek-V4 and simplifies it: K and V are separate per KV head, RoPE turns whole heads and
only K carries it (so relocation rotates the query and needs no output de-rotation), there is no sink, no
compressor and no MoE, and `W_o` is sliced directly by head channels: W_o O = W_o,L O_L + W_o,G O_G.
Roles are per KV group: in each group of `heads_per_kv` query heads the first `global_per_group` are Global.
Segments need no alignment (no compression blocks): the profile's `align` should be 1.

The draft (`LlamaAdapter.draft_attention`) is this family's stand-in for DeepSeek's native indexer (SPEC §5's
I_top: rows the question picks): after the first fences, the question rows alone run on through the reusable
layers over every relocated row's artifact K/V (what the naive arm sees); the attention probability their heads
give each relocated row, summed over those layers, rows and heads, ranks the rows."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from runtime.llama.artifacts import LlamaArtifact, Relocated, expectations, global_heads, relocate
from runtime.llama.model import KVCache, Llama, LayerCache, merge
from runtime.reuse.controller import doc_offsets
from runtime.reuse.ledger import OPS, RowLedger
from runtime.reuse.loop import Pass, ReuseResult
from runtime.reuse.profile import ProfileError, ReuseProfile
from runtime.reuse.signals import attention_mass, rel_deviation

@dataclass
class LlamaLedger(RowLedger):
    """The shared row namespaces (SPEC §7) for a Llama-family model, and its analytic FLOPs (projections,
    attention, MLP) against the recompute arm's, in total and per operator (`flop_saving`: the MLP under the
    shared key "moe", the FFN of either family; no indexer)."""
    n_layers: int
    n_heads: int
    dims: tuple[int, int, int, int] = (0, 0, 0, 0)     # hidden, head dim, KV heads, MLP width
    prof: ReuseProfile | None = None                   # for the structural ceiling
    active_rows: tuple[int, ...] = ()                  # the relocated rows chosen active, ids among them
    flops: float = 0.0
    flops_recompute: float = 0.0
    ops: dict = field(default_factory=lambda: dict.fromkeys(OPS, 0.0))
    ops_recompute: dict = field(default_factory=lambda: dict.fromkeys(OPS, 0.0))
    ttft_s: dict = field(default_factory=dict)

    def _row(self, heads: int, keys: float, mlp: bool, qkv_heads: int | None = None) -> dict:
        d, D, KV, ffn = self.dims
        qh = heads if qkv_heads is None else qkv_heads
        return {"projections": 2 * d * D * qh + 2 * d * D * 2 * KV * (qkv_heads is None) + 2 * heads * D * d,
                "attention": 4 * heads * D * keys, "indexer": 0.0, "moe": 6 * d * ffn if mlp else 0}

    def flops_row(self, heads: int, keys: float, mlp: bool, qkv_heads: int | None = None) -> float:
        """One row of one layer: Q (and K/V unless `qkv_heads`: only those heads' Q), attention over `keys`
        keys, W_o, and the MLP when it runs."""
        return sum(self._row(heads, keys, mlp, qkv_heads).values())

    def add(self, rows: float, heads: int, keys: float, mlp: bool, qkv_heads: int | None = None) -> None:
        """`rows` rows of one layer computed online (`flops_row` each)."""
        for k, f in self._row(heads, keys, mlp, qkv_heads).items():
            self.ops[k] += rows * f
            self.flops += rows * f

    def recompute(self, T: int) -> None:
        """The recompute arm: every row, every layer; a row at position t attends t+1 keys."""
        row = self._row(self.n_heads, 0, True)
        row["attention"] = 4 * self.n_heads * self.dims[1] * (T + 1) / 2
        self.ops_recompute = {k: self.n_layers * T * f for k, f in row.items()}
        self.flops_recompute = sum(self.ops_recompute.values())

    def fence(self, rows: int, keys: float) -> None:
        self.head_rows_computed += self.n_reloc * self.n_heads
        self.add(rows, self.n_heads, keys, True)

    def reusable(self, n_act: int, n_new: int, n_rest: int, global_heads: int, keys: float, rest_ffn: bool) -> None:
        """A reusable layer (or an artifact-KV last fence, `global_heads` 0, `n_rest` 0): `n_act` active relocated
        and `n_new` new rows in full, `n_rest` other relocated rows on their Global heads."""
        self.head_rows_computed += n_act * self.n_heads + (self.n_reloc - n_act) * global_heads
        self.token_rows_skipped += self.n_reloc - n_act
        self.add(n_act + n_new, self.n_heads, keys, True)
        self.add(n_rest, global_heads, keys, rest_ffn, qkv_heads=global_heads)

    def flop_saving(self) -> dict:
        out = {k: (1 - self.ops[k] / r) if r else 0.0 for k, r in self.ops_recompute.items()}
        out["total"] = 1 - self.flops / self.flops_recompute if self.flops_recompute else 0.0
        out["ratio"] = self.flops_recompute / self.flops if self.flops else float("inf")
        return out

    def structural_ceiling(self) -> float:
        """The head-row saving at budget 0: the Local heads of every reusable layer (every head of an artifact-KV
        last fence) over every layer's heads."""
        p = self.prof
        if p is None:
            return 0.0
        G = self.n_heads // self.dims[2]
        full = p.last_fences if p.last_fence_kv == "artifact" else 0
        reusable = self.n_layers - p.first_fences - p.last_fences
        return (reusable * (1 - p.global_per_group / G) + full) / self.n_layers

    def summary(self) -> dict:
        """The four namespaces as DeepSeek-V4's ledger reports them (the API's shape), and `flop_ratio`."""
        saving = self.flop_saving()
        return {"rows": self.rows(), "head_row_saving": self.head_row_saving(),
                "structural_ceiling": self.structural_ceiling(), "token_row_saving": self.token_row_saving(),
                "flop_saving": saving, "ttft_s": dict(self.ttft_s), "flop_ratio": saving["ratio"]}


class LlamaAdapter:
    """The Llama family's side of the reuse engine over one model and profile (`runtime/reuse/engine.py`): its
    passes (`begin`: per-segment attention with queries rotated per segment and an LSE merge; `cache_pass`: the
    request's own KV cache, relocated once) and the per-layer math they run. `mode`: "reuse" or "naive".
    `split_heads`: the cache path's reusable attention split by heads (`reusable_attention`; default: off CUDA).
    In the last fences with `last_fence_kv="artifact"` (`full_layers`), non-active rows keep their artifact K/V
    and every head of active and new rows is computed."""
    family = "llama"

    def __init__(self, model: Llama, prof: ReuseProfile, mode: str = "reuse", split_heads: bool | None = None):
        c = model.cfg
        if prof.first_fences + prof.last_fences > len(model.layers):
            raise ValueError("fences exceed the model's layers")
        if prof.ffn_mode not in ("skip", "native"):
            raise ProfileError(f"ffn_mode={prof.ffn_mode!r}: a Llama layer has no shared expert (skip or native)")
        if not 1 <= prof.global_per_group <= c.heads_per_kv:
            raise ProfileError(f"global_per_group={prof.global_per_group} not in 1..{c.heads_per_kv}")
        self.model, self.prof, self.mode = model, prof, mode
        self.n_layers = len(model.layers)
        self.full_layers = set(range(self.n_layers - prof.last_fences, self.n_layers)) \
            if mode == "reuse" and prof.last_fence_kv == "artifact" else set()
        self.split_heads = split_heads if split_heads is not None else \
            next(model.parameters()).device.type != "cuda"
        self.gmask = global_heads(model, prof)
        self.H, self.KV, self.D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.dims = (c.hidden_size, c.head_dim, c.num_key_value_heads, c.intermediate_size)

    def expectations(self, fingerprint: str = "") -> dict:
        return expectations(self.model, fingerprint)

    def stop_tokens(self) -> set[int]:
        return set(self.model.cfg.eos_token_ids)

    def scope(self):
        return contextlib.nullcontext()

    def is_fence(self, i: int) -> bool:
        """A layer that recomputes every row from its hidden state."""
        return self.mode == "reuse" and (i < self.prof.first_fences or (
            i >= self.n_layers - self.prof.last_fences and i not in self.full_layers))

    def begin(self, docs: list[LlamaArtifact], question: list[int]) -> "SegmentsPass":
        return SegmentsPass(self, docs, question)

    def cache_pass(self, docs: list[LlamaArtifact], question: list[int], reloc: Relocated | None = None) -> "CachePass":
        return CachePass(self, docs, question, reloc if reloc is not None else relocate(self.model, docs))

    def decode_batch(self, states: list, tokens: list[int]) -> torch.Tensor:
        """One new row per request, request by request: on a request cache (`cache_pass`) the model's own forward;
        on a per-segment state (`begin`) the per-segment layers. [B, V]"""
        return torch.stack([self.model(torch.tensor([t], device=self.model.embed_tokens.weight.device), s)
                            if isinstance(s, KVCache) else self._decode(s, t) for s, t in zip(states, tokens)])

    def _decode(self, state: dict, token: int) -> torch.Tensor:
        m = self.model
        dev = m.embed_tokens.weight.device
        pos = torch.tensor([state["pos"]], device=dev)
        x = m.embed(torch.tensor([token], device=dev))
        none = torch.zeros(0, dtype=torch.bool, device=dev)
        uncounted = self.ledger(0, 0, 0)
        for i, layer in enumerate(m.layers):
            if i in state["fence"]:
                x = layer(x, pos, state["fence"][i])
            else:
                x = self.layer(i, layer, x, pos, None, None, none, 0, state, uncounted)
        state["pos"] += 1
        return m.logits(x)[0]

    def ledger(self, n_prefix: int, n_reloc: int, n_new: int) -> LlamaLedger:
        return LlamaLedger(n_prefix=n_prefix, n_reloc=n_reloc, n_new=n_new, n_layers=self.n_layers, n_heads=self.H,
                           dims=self.dims, prof=self.prof)

    def deviation(self, k_req, v_req, k_art, v_art) -> torch.Tensor:
        """The first fences' per-row signal: the rows' request-context K against the artifact's K moved to the
        request frame (with signal "kv", plus the same for V, which carries no RoPE: compared as stored)."""
        dev = rel_deviation(k_req, k_art)
        return dev + rel_deviation(v_req, v_art) if self.prof.signal == "kv" else dev

    @staticmethod
    def fence(layer, x: torch.Tensor, positions: torch.Tensor, prefix: LlamaArtifact, i: int):
        """A fence layer: the model's own layer over every computed row after the prefix's K/V. Returns the new
        hidden rows, the layer's cache (prefix and computed rows at request positions) and the rows' K and V."""
        lc = LayerCache()
        lc.append(prefix.k[i], prefix.v[i])
        lc.capture = {}
        x = layer(x, positions, lc)
        k, v, lc.capture = lc.capture["k"], lc.capture["v"], None
        return x, lc, k, v

    def draft_attention(self, xq: torch.Tensor, pos_q: torch.Tensor, reloc: Relocated, n0: int, q_start: int,
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
            score += attention_mass(q, keys[n0:q_start], lse, attn.scale)
            h = xq + attn.project(o.to(xq.dtype))
            xq = h + layer.mlp(layer.post_attention_layernorm(h))
        led.add(len(layers) * xq.shape[0], self.H, (q_start + T + 1) / 2, True)
        return score

    def reusable_attention(self, attn, q, lc, positions, k_pos, sel, heads) -> torch.Tensor:
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

    def cache_layer(self, i: int, layer, x, positions, sel, heads, rest, docs, lc, T_all: int, k_pos):
        """One reusable layer (or artifact-KV last fence) on the request's own cache: the computed rows' (`sel`)
        K/V written over the relocated ones at their request positions, then every row's attention over the
        cache (`reusable_attention`; every head in a full layer), the artifact's W_o,L O_L added onto the other
        relocated rows (`rest`: 1 on those rows), the MLP per ffn_mode. Returns (x, positions, sel): in a full
        layer the non-active rows are dropped for good (no later layer reads them)."""
        attn, n_reloc = layer.self_attn, rest.shape[0]
        full = i in self.full_layers
        if full and x.shape[0] != sel.shape[0]:
            x, positions = x[sel], positions[sel]
            sel = torch.arange(x.shape[0], device=x.device)
        q, k, v = attn.qkv(layer.input_layernorm(x), positions)
        lc.k.index_copy_(0, positions[sel], k[sel].to(lc.k.dtype))
        lc.v.index_copy_(0, positions[sel], v[sel].to(lc.v.dtype))
        lc.n = T_all
        if full:
            o, _ = attn.attend(q, lc.k, lc.v, positions, k_pos)
            h2 = x + attn.project(o.to(x.dtype))
        else:
            # non-active rows: W_o,G O_G + bias + the artifact's W_o,L O_L (their Local heads' outputs zeroed)
            h2 = x + attn.project(self.reusable_attention(attn, q, lc, positions, k_pos, sel, heads))
            if n_reloc:
                h2[:n_reloc] += torch.cat([d.local_at(i, x.dtype) for d in docs[1:]]) * rest
        if self.prof.ffn_mode == "native" or full:
            h2 = h2 + layer.mlp(layer.post_attention_layernorm(h2))
        else:
            h2.index_add_(0, sel, layer.mlp(layer.post_attention_layernorm(h2[sel])))
        return h2, positions, sel

    def segments(self, i, attn, h, docs, deltas, active, n_rc, dev):
        """Per segment (shift, k canonical, v, canonical start): prefix and relocated from their artifacts, with
        active rows' recomputed K/V overlaid on copies; a row's request position is its canonical one plus the
        shift (its offset less the artifact's start: documents built after a preamble start after it)."""
        segs = [(0, docs[0].k[i], docs[0].v[i], docs[0].start)]
        a = 0
        for d, dl in zip(docs[1:], deltas[1:]):
            k, v = d.k[i], d.v[i]
            if n_rc and active[a:a + d.n].any():
                act = active[a:a + d.n]
                cpos = torch.arange(d.start, d.start + d.n, device=dev)[act]
                _, k_new, v_new = attn.qkv(h[a:a + d.n][act], cpos)
                k, v = k.clone(), v.clone()
                k[act], v[act] = k_new.to(k.dtype), v_new.to(v.dtype)
            segs.append((dl - d.start, k, v, d.start))
            a += d.n
        return segs

    def _attend(self, attn, q, qpos, segs):
        parts = []
        for dl, k, v, c0 in segs:
            qr = attn.rotary.rotate(q, torch.full((q.shape[0],), -dl, device=q.device))
            parts.append(attn.attend(qr, k, v, qpos - dl, torch.arange(c0, c0 + k.shape[0], device=q.device)))
        return merge(parts)[0]

    def layer(self, i, layer, x, positions, docs, deltas, active, n_rc, state, led):
        attn, dev = layer.self_attn, x.device
        h = layer.input_layernorm(x)
        if i not in state["segs"]:
            state["segs"][i] = self.segments(i, attn, h, docs, deltas, active, n_rc, dev)
        segs = state["segs"][i]
        nrows = slice(n_rc, x.shape[0])
        q_new, k_new, v_new = attn.qkv(h[nrows], positions[nrows])
        k_new = attn.rotary.rotate(k_new, torch.full((k_new.shape[0],), -state["delta_q"], device=dev))
        nk, nv = state["new"].get(i, (k_new[:0], v_new[:0]))
        nk, nv = torch.cat([nk, k_new]), torch.cat([nv, v_new])
        state["new"][i] = (nk, nv)
        all_segs = segs + [(state["delta_q"], nk, nv, 0)]
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
            local = torch.cat([d.local_at(i, y.dtype) for d in docs[1:]])
            out[rest] = (y + local[rest]).to(out.dtype)
        h2 = x + out
        rest_ffn = self.prof.ffn_mode == "native" and not full
        mlp_rows = torch.ones_like(row_active) if rest_ffn else row_active
        if mlp_rows.any():
            rows = torch.nonzero(mlp_rows).flatten()
            h2[rows] = h2[rows] + layer.mlp(layer.post_attention_layernorm(h2[rows]))
        n_act = int(row_active[:n_rc].sum())
        led.reusable(n_act, x.shape[0] - n_rc, int(rest.numel()), int(self.gmask.sum()) if n_rc and not full else 0,
                     positions.float().mean().item() + 1, rest_ffn)
        return h2

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
            segs = state["segs"][i] + [(state["delta_q"],) + state["new"][i] + (0,)]
            lc = LayerCache()
            lc.append(torch.cat([rot.rotate(k, torch.full((k.shape[0],), dl, device=k.device))
                                 for dl, k, _, _ in segs]), torch.cat([v for _, _, v, _ in segs]))
            assert lc.n == state["pos"], f"layer {i}: {lc.n} rows assembled, the request has {state['pos']}"
            layers.append(lc)
        return KVCache(layers, pos=state["pos"])


def _record(led: LlamaLedger, active: torch.Tensor) -> torch.Tensor:
    """The chosen relocated rows in the ledger (`active`, `active_rows`); the mask on the host."""
    active = active.cpu()
    led.active = int(active.sum())
    led.active_rows = tuple(active.nonzero().flatten().tolist())
    return active


class LlamaPass(Pass):
    """What both Llama passes share: the controller ranks on a host copy of the deviations (one transfer; no
    indexer class on this family), and the adapter says which layers are fences."""
    ad: LlamaAdapter

    def signals(self):
        return self.deviation.cpu(), None

    def is_fence(self, i: int) -> bool:
        return self.ad.is_fence(i)


class SegmentsPass(LlamaPass):
    """The reference pass: every segment's K/V where it lies (the artifact's, active rows' overlaid on copies),
    queries rotated per segment, partial outputs merged by log-sum-exp. Its state (`finish`) continues through
    `LlamaAdapter._decode`, or as one cache through `LlamaAdapter.assemble`."""

    def __init__(self, ad: LlamaAdapter, docs: list[LlamaArtifact], question: list[int]):
        m = ad.model
        dev = next(m.parameters()).device
        super().__init__(ad.prof, [d.n for d in docs], doc_offsets([d.n for d in docs]), len(question), ad.n_layers,
                         dev)
        self.ad, self.docs = ad, docs
        T_all = self.q_start + self.n_q
        self.led = ad.ledger(docs[0].n, self.n_reloc, self.n_q)
        self.led.recompute(T_all)
        naive = ad.mode == "naive"
        computed = list(range(self.q_start if naive else docs[0].n, T_all))
        tok_all = torch.tensor([t for d in docs for t in d.tokens] + list(question), device=dev)
        self.positions = torch.tensor(computed, device=dev)
        self.x = m.embed(tok_all[self.positions])
        self.n_rc = 0 if naive else self.n_reloc              # relocated rows this arm computes
        self.state = {"fence": {}, "segs": {}, "new": {}, "delta_q": self.q_start, "pos": T_all}

    def fence(self, i: int, signals: bool) -> None:
        ad, layer = self.ad, self.ad.model.layers[i]
        self.x, lc, k_req, v_req = ad.fence(layer, self.x, self.positions, self.docs[0], i)
        self.state["fence"][i] = lc
        self.led.fence(self.x.shape[0], self.positions.float().mean().item() + 1)
        if signals:
            a, dev = 0, self.x.device
            for d, dl in zip(self.docs[1:], self.deltas[1:]):
                moved = layer.self_attn.rotary.rotate(d.k[i], torch.full((d.n,), dl - d.start, device=dev))
                self.deviation[a:a + d.n] += ad.deviation(k_req[a:a + d.n], v_req[a:a + d.n], moved, d.v[i])
                a += d.n

    def draft(self) -> torch.Tensor:
        nq = self.n_q
        return self.ad.draft_attention(self.x[-nq:], self.positions[-nq:], relocate(self.ad.model, self.docs),
                                       self.docs[0].n, self.q_start, self.led).cpu()

    def activate(self, active: torch.Tensor) -> None:
        self.active = _record(self.led, active).to(self.x.device)
        self.chosen = self.active

    def narrow(self, active: torch.Tensor) -> None:
        self.active = active.to(self.x.device)

    def reusable(self, i: int) -> None:
        self.x = self.ad.layer(i, self.ad.model.layers[i], self.x, self.positions, self.docs, self.deltas,
                               self.active, self.n_rc, self.state, self.led)

    def finish(self) -> ReuseResult:
        act = self.docs[0].n + self.chosen.nonzero().flatten()
        return ReuseResult(self.ad.model.logits(self.x[-1:])[0], self.led, act, self.state)


class CachePass(LlamaPass):
    """The pass on the request's own KV cache: every layer's K/V held at request positions (relocated rows'
    artifact K rotated once, `relocate`), active and new rows' K/V computed at their request positions and written
    over them, and each layer's rows attending once over the whole cache with the causal mask (RoPE: R(a) R(b) =
    R(a+b), so this equals `SegmentsPass` up to rounding). The naive arm is the model's own layers over the
    question on the relocated cache. Its state is the KVCache plain decoding continues; its ledger equals
    `SegmentsPass`'s; two host syncs (the deviations to the host controller, the mean key count) instead of
    several per layer."""

    def __init__(self, ad: LlamaAdapter, docs: list[LlamaArtifact], question: list[int], reloc: Relocated):
        m = ad.model
        dev = next(m.parameters()).device
        super().__init__(ad.prof, [d.n for d in docs], doc_offsets([d.n for d in docs]), len(question), ad.n_layers,
                         dev)
        assert reloc.n == self.q_start, (reloc.n, self.q_start)
        self.ad, self.docs, self.reloc = ad, docs, reloc
        T_all = self.q_start + self.n_q
        self.T_all, self.n0 = T_all, docs[0].n
        self.led = ad.ledger(self.n0, self.n_reloc, self.n_q)
        self.led.recompute(T_all)
        layers = []
        for i in range(ad.n_layers):                       # the relocated rows, room for the new ones
            k = reloc.k[i].new_empty((T_all,) + reloc.k[i].shape[1:])
            v = reloc.v[i].new_empty((T_all,) + reloc.v[i].shape[1:])
            k[:self.q_start], v[:self.q_start] = reloc.k[i], reloc.v[i]
            layers.append(LayerCache(k, v, self.q_start))
        self.cache = KVCache(layers, pos=self.q_start)
        self.naive = ad.mode == "naive"
        first = self.q_start if self.naive else self.n0
        tokens = ([] if self.naive else [t for d in docs[1:] for t in d.tokens]) + list(question)
        self.positions = torch.arange(first, T_all, device=dev)
        self.keys = self.positions.float().mean().item() + 1
        self.k_pos = torch.arange(T_all, device=dev)
        self.x = m.embed(torch.tensor(tokens, device=dev))

    def fence(self, i: int, signals: bool) -> None:
        ad, n0, n = self.ad, self.n0, self.n_reloc
        self.x, self.cache.layers[i], k_req, v_req = ad.fence(ad.model.layers[i], self.x, self.positions,
                                                              self.docs[0], i)
        self.led.fence(self.x.shape[0], self.keys)
        if signals:
            self.deviation += ad.deviation(k_req[:n], v_req[:n], self.reloc.k[i][n0:], self.reloc.v[i][n0:])

    def draft(self) -> torch.Tensor:
        nq = self.n_q
        return self.ad.draft_attention(self.x[-nq:], self.positions[-nq:], self.reloc, self.n0, self.q_start,
                                       self.led).cpu()

    def activate(self, active: torch.Tensor) -> None:
        # the controller ranks and fills classes row by row on a host copy (one transfer), not the device
        self._compute(_record(self.led, active))
        self.chosen = self.active

    def narrow(self, active: torch.Tensor) -> None:
        self._compute(active.cpu())

    def _compute(self, active: torch.Tensor) -> None:
        """The rows the next reusable layers compute: the active relocated rows (a host mask) and the new ones."""
        dev = self.x.device
        computed = torch.cat([active, torch.ones(self.n_q, dtype=torch.bool)])            # rows of x
        self.sel = computed.nonzero().flatten().to(dev)
        computed, self.active = computed.to(dev), active.to(dev)
        self.n_act = self.sel.shape[0] - self.n_q
        # per row and head: every head of a computed row, the Global heads of the others
        self.heads = (computed[:, None] | self.ad.gmask.to(dev)[None, :]).to(self.x.dtype)[:, :, None]
        self.rest = (~self.active).to(self.x.dtype)[:, None]

    def reusable(self, i: int) -> None:
        ad, layer = self.ad, self.ad.model.layers[i]
        if self.naive:                           # the model's own layer over the question rows
            self.x = layer(self.x, self.positions, self.cache.layers[i])
            self.led.reusable(0, self.n_q, 0, 0, self.keys, False)
            return
        full = i in ad.full_layers
        self.x, self.positions, self.sel = ad.cache_layer(i, layer, self.x, self.positions, self.sel, self.heads,
                                                          self.rest, self.docs, self.cache.layers[i], self.T_all,
                                                          self.k_pos)
        self.led.reusable(self.n_act, self.n_q, 0 if full else self.n_reloc - self.n_act,
                          0 if full else int(self.ad.gmask.sum()), self.keys,
                          self.ad.prof.ffn_mode == "native" and not full)

    def finish(self) -> ReuseResult:
        self.cache.pos = self.T_all
        act = self.n0 + self.chosen.nonzero().flatten()
        return ReuseResult(self.ad.model.logits(self.x[-1:])[0], self.led, act, self.cache)
