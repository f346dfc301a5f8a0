"""The Llama family's side of the reuse path (Llama, Qwen2, SmolLM2): its artifacts, their producer and
relocation, and the per-layer math the engine (`runtime/reuse/llama_engine.py`) runs under the shared controller,
ledger and certificate.

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

from dataclasses import dataclass

import torch

from runtime.llama.model import KVCache, Llama, LayerCache, merge
from runtime.reuse.certificate import Certificate, token_hash
from runtime.reuse.controller import doc_offsets
from runtime.reuse.ledger import RowLedger
from runtime.reuse.profile import ReuseProfile
from runtime.reuse.signals import attention_mass, rel_deviation

PRODUCER_VERSION = "redknot-llama-producer/1"

@dataclass
class LlamaArtifact:
    tokens: list[int]
    k: list[torch.Tensor]                     # per layer [n, KV, D], RoPE at canonical positions 0..n-1
    v: list[torch.Tensor]                     # per layer [n, KV, D]
    local: list[torch.Tensor | None]          # per layer [n, d]: W_o,L O_L in reusable layers
    cert: Certificate | None = None           # what the artifact is certified for (`certify`)

    @property
    def n(self) -> int:
        return len(self.tokens)


def expectations(model: Llama, fingerprint: str = "") -> dict:
    """What a consumer on `model` requires of a certificate (`certificate.validate`'s keywords but the token hash,
    profile and generation): one rank holding every head and channel, every layer's K/V, the model's dtype and
    this producer. `fingerprint`: the checkpoint's, where the caller has one (the eval harness produces and
    consumes on one loaded model and leaves it empty)."""
    return dict(fingerprint=fingerprint, tp_size=1, tp_rank=0, channel_range=(0, model.cfg.hidden_size),
                layers_needed=set(range(len(model.layers))),
                dtype=str(next(model.parameters()).dtype).removeprefix("torch."), producer_version=PRODUCER_VERSION)


def certify(model: Llama, tokens: list[int], prof: ReuseProfile, tokenizer_fp: str = "",
            fingerprint: str = "") -> Certificate:
    """The certificate of an artifact of `tokens` produced on `model` for `prof` (held in memory: generation 0,
    no shard digests), in the shared certificate format the DeepSeek artifacts use."""
    e = expectations(model, fingerprint)
    return Certificate(e["fingerprint"], token_hash(tokens, tokenizer_fp), len(tokens), prof.to_dict(), 1, 0,
                       e["channel_range"], tuple(sorted(e["layers_needed"])), e["dtype"], PRODUCER_VERSION)


def global_heads(model: Llama, prof: ReuseProfile) -> torch.Tensor:
    G = model.cfg.num_attention_heads // model.cfg.num_key_value_heads
    return torch.arange(model.cfg.num_attention_heads) % G < prof.global_per_group


@torch.inference_mode()
def produce_llama(model: Llama, tokens: list[int], prof: ReuseProfile, tokenizer_fp: str = "",
                  fingerprint: str = "") -> LlamaArtifact:
    return produce_llama_many(model, tokens, [prof], tokenizer_fp, fingerprint)[0]


@torch.inference_mode()
def produce_llama_many(model: Llama, tokens: list[int], profs: list[ReuseProfile], tokenizer_fp: str = "",
                       fingerprint: str = "") -> list[LlamaArtifact]:
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
                                 certify(model, tokens, prof, tokenizer_fp, fingerprint)))
    return out


@torch.inference_mode()
def produce_llama_packed(model: Llama, segments: list[list[int]], profs: list[ReuseProfile], tokenizer_fp: str = "",
                         fingerprint: str = "") -> list[list[LlamaArtifact]]:
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
                                  certify(model, t, prof, tokenizer_fp, fingerprint))
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
    deltas = doc_offsets([d.n for d in docs])
    pos = deltas[-1] + docs[-1].n
    dev = docs[0].k[0].device
    shift = torch.tensor([dl for d, dl in zip(docs, deltas) for _ in range(d.n)], device=dev)
    L = len(model.layers)
    k = torch.cat([torch.stack(d.k, dim=1) for d in docs])                # [q_start, L, KV, D]
    k = model.rotary.rotate(k, shift)
    v = torch.cat([torch.stack(d.v, dim=1) for d in docs])
    return Relocated([k[:, i] for i in range(L)], [v[:, i] for i in range(L)], deltas, pos)



@dataclass
class LlamaLedger(RowLedger):
    """The shared row namespaces (SPEC §7) for a Llama-family model, and one analytic FLOP count (projections,
    attention, MLP) against the recompute arm's."""
    n_layers: int
    n_heads: int
    dims: tuple[int, int, int, int] = (0, 0, 0, 0)     # hidden, head dim, KV heads, MLP width
    active_rows: tuple[int, ...] = ()                  # the relocated rows chosen active, ids among them
    flops: float = 0.0
    flops_recompute: float = 0.0

    def flops_row(self, heads: int, keys: float, mlp: bool, qkv_heads: int | None = None) -> float:
        """One row of one layer: Q (and K/V unless `qkv_heads`: only those heads' Q), attention over `keys`
        keys, W_o, and the MLP when it runs."""
        d, D, KV, ffn = self.dims
        qh = heads if qkv_heads is None else qkv_heads
        f = 2 * d * D * qh + 2 * d * D * 2 * KV * (qkv_heads is None) + 2 * heads * D * d + 4 * heads * D * keys
        return f + (6 * d * ffn if mlp else 0)

    def recompute(self, T: int) -> None:
        """The recompute arm: every row, every layer; a row at position t attends t+1 keys."""
        self.flops_recompute = self.n_layers * (T * self.flops_row(self.n_heads, 0, True)
                                                + 4 * self.n_heads * self.dims[1] * T * (T + 1) / 2)

    def fence(self, rows: int, keys: float) -> None:
        self.head_rows_computed += self.n_reloc * self.n_heads
        self.flops += rows * self.flops_row(self.n_heads, keys, True)

    def reusable(self, n_act: int, n_new: int, n_rest: int, global_heads: int, keys: float, rest_ffn: bool) -> None:
        """A reusable layer (or an artifact-KV last fence, `global_heads` 0, `n_rest` 0): `n_act` active relocated
        and `n_new` new rows in full, `n_rest` other relocated rows on their Global heads."""
        self.head_rows_computed += n_act * self.n_heads + (self.n_reloc - n_act) * global_heads
        self.token_rows_skipped += self.n_reloc - n_act
        self.flops += (n_act + n_new) * self.flops_row(self.n_heads, keys, True) + \
            n_rest * self.flops_row(global_heads, keys, rest_ffn, qkv_heads=global_heads)

    def summary(self) -> dict:
        return {"rows": self.rows(), "head_row_saving": self.head_row_saving(),
                "token_row_saving": self.token_row_saving(),
                "flop_ratio": self.flops_recompute / self.flops if self.flops else float("inf")}


class LlamaAdapter:
    """The per-layer math of the reuse path on one Llama-family model and profile. `full_layers`: the last fences
    that keep non-active rows' artifact K/V (every head of active and new rows is computed there). `split_heads`:
    the cache path's reusable attention split by heads (`reusable_attention`)."""

    def __init__(self, model: Llama, prof: ReuseProfile, full_layers: set[int], split_heads: bool):
        c = model.cfg
        self.model, self.prof, self.full_layers, self.split_heads = model, prof, full_layers, split_heads
        self.gmask = global_heads(model, prof)
        self.n_layers = len(model.layers)
        self.H, self.KV, self.D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.dims = (c.hidden_size, c.head_dim, c.num_key_value_heads, c.intermediate_size)

    def ledger(self, n_prefix: int, n_reloc: int, n_new: int) -> LlamaLedger:
        return LlamaLedger(n_prefix=n_prefix, n_reloc=n_reloc, n_new=n_new, n_layers=self.n_layers, n_heads=self.H,
                           dims=self.dims)

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
        led.flops += len(layers) * xq.shape[0] * led.flops_row(self.H, (q_start + T + 1) / 2, True)
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
                h2[:n_reloc] += torch.cat([d.local[i] for d in docs[1:]]).to(x.dtype) * rest
        if self.prof.ffn_mode == "native" or full:
            h2 = h2 + layer.mlp(layer.post_attention_layernorm(h2))
        else:
            h2.index_add_(0, sel, layer.mlp(layer.post_attention_layernorm(h2[sel])))
        return h2, positions, sel

    def segments(self, i, attn, h, docs, deltas, active, n_rc, dev):
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

    def layer(self, i, layer, x, positions, docs, deltas, active, n_rc, state, led):
        attn, dev = layer.self_attn, x.device
        h = layer.input_layernorm(x)
        if i not in state["segs"]:
            state["segs"][i] = self.segments(i, attn, h, docs, deltas, active, n_rc, dev)
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
            segs = state["segs"][i] + [(state["delta_q"],) + state["new"][i]]
            lc = LayerCache()
            lc.append(torch.cat([rot.rotate(k, torch.full((k.shape[0],), dl, device=k.device)) for dl, k, _ in segs]),
                      torch.cat([v for _, _, v in segs]))
            assert lc.n == state["pos"], f"layer {i}: {lc.n} rows assembled, the request has {state['pos']}"
            layers.append(lc)
        return KVCache(layers, pos=state["pos"])
