"""Llama-family decoder (Llama, Qwen2), top-down: token embedding; per layer RMSNorm -> GQA attention with
rotate-half RoPE on whole heads -> residual, RMSNorm -> SwiGLU MLP -> residual; final RMSNorm and the LM
head (tied to the embedding or not).

Each attention layer exposes the pieces the reuse engine composes:
- `qkv(x, positions)`: q [T,H,D] and k [T,KV,D] roped at `positions`, v [T,KV,D];
- `attend(q, k, v, q_pos, k_pos)`: queries against given K/V rows -> (output [T,H,D], natural-log LSE [T,H]);
- `merge(parts)`: exact log-sum-exp merge of partial outputs over disjoint key sets;
- `project(o, heads)`: W_o, optionally on a subset of heads (head h owns input channels h*D:(h+1)*D of
  o_proj), so Global and Local heads of each KV group project separately. There is no output RoPE.
RoPE is a rotation per position, so a roped row moves by `rotary.rotate(x, delta)` (R(a) R(b) = R(a+b)).

Parameter names equal transformers' (without its `model.` prefix), so checkpoints load by name.
Shapes: T = query rows, S = key rows, H = query heads, KV = KV heads, G = H // KV, D = head_dim,
d = hidden_size, V = vocab. Batch size is one request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import LlamaConfig

NEG_INF = float("-inf")


# ============================================================================ norm and rotary

class RMSNorm(nn.Module):
    """Normalized in float32, cast back, then weighted (the weight in the model dtype, as transformers)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequency of each rotary pair [D/2]; `linear` divides all by the factor, `llama3` divides the
    long wavelengths, keeps the short ones and blends smoothly in between."""
    D = cfg.head_dim
    # built on the CPU explicitly, also when the model is constructed under a meta-device context
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D))
    if cfg.rope_type == "linear":
        return inv / cfg.rope_factor
    if cfg.rope_type == "llama3":
        old = cfg.rope_original_max_position
        low_wavelen = old / cfg.rope_low_freq_factor
        high_wavelen = old / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        smooth = (old / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        blended = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv


class Rotary:
    """Rotate-half RoPE on the whole head: channel i pairs with i + D/2 (transformers' Llama convention)."""

    def __init__(self, inv_freq: torch.Tensor):
        # a plain attribute, not a buffer: derived from the config, never loaded, moved on first use
        self.inv_freq = inv_freq
        # the last positions tensor and its cos/sin: every layer of one forward passes the same tensor, so the
        # table is computed once per forward (the tensor is held here, so its identity cannot be reused)
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (any integers, negative too) -> cos, sin [T, D] in float32."""
        if self._last is not None and self._last[0] is positions:
            return self._last[1], self._last[2]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        self._last = (positions, cos, sin)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, ..., D]; cos/sin [T, D]. Computed in float32, returned in x's dtype."""
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        c, s = cos.view(shape), sin.view(shape)
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * c + rotated * s).to(x.dtype)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate each row of x [T, ..., D] by its position (or by a relative offset)."""
        return self.apply(x, *self.cos_sin(positions))


# ============================================================================ attention pieces

def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None = None,
           k_pos: torch.Tensor | None = None, scale: float | None = None,
           q_chunk: int = 1024, q_seg: torch.Tensor | None = None,
           k_seg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries q [T,H,D] against key/value rows k, v [S,KV,D]; query head h reads KV head h // G.
    With positions, query t sees key s iff k_pos[s] <= q_pos[t]; without, every row is visible. With segment
    ids (packed independent sequences) also only iff k_seg[s] == q_seg[t].
    Scores and the softmax are float32. Returns (o [T,H,D] in v's dtype, lse [T,H] float32, natural log);
    a query that sees no key gets o = 0 and lse = -inf, so it drops out of a `merge`."""
    T, H, D = q.shape
    S, KV = k.shape[0], k.shape[1]
    assert k.shape == v.shape == (S, KV, D), f"k {tuple(k.shape)}, v {tuple(v.shape)} vs q {tuple(q.shape)}"
    assert H % KV == 0, f"{H} query heads over {KV} KV heads"
    assert (q_pos is None) == (k_pos is None), "give both q_pos and k_pos, or neither"
    scale = D ** -0.5 if scale is None else scale
    qg = q.view(T, KV, H // KV, D).float()
    kf = k.float()
    outs, lses = [], []
    for a in range(0, T, q_chunk):
        b = min(a + q_chunk, T)
        s = torch.einsum("tkgd,skd->tkgs", qg[a:b], kf) * scale
        if q_pos is not None:
            visible = k_pos[None, :] <= q_pos[a:b, None]                   # [t, S]
            if q_seg is not None:
                visible &= k_seg[None, :] == q_seg[a:b, None]
            s = torch.where(visible[:, None, None, :], s, NEG_INF)
        lse = torch.logsumexp(s, dim=-1)                                   # [t, KV, G]
        safe = torch.where(torch.isinf(lse), 0.0, lse)
        p = torch.exp(s - safe.unsqueeze(-1))
        outs.append(torch.einsum("tkgs,skd->tkgd", p.to(v.dtype), v))
        lses.append(lse)
    o, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))
    return o.reshape(T, H, D), lse.reshape(T, H)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention outputs over disjoint key sets, each (o [T,H,D], lse [T,H]), into the output
    over their union: (o float32, lse). Exact up to rounding; empty parts (lse -inf) weigh 0."""
    total = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)    # [T, H]
    safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    out = torch.zeros_like(parts[0][0], dtype=torch.float32)
    for o, lse in parts:
        out = out + torch.exp(lse - safe).unsqueeze(-1) * o.float()
    return out, total


# ============================================================================ cache

@dataclass
class LayerCache:
    """K/V rows of one layer at positions 0..n-1, in buffers that grow by doubling."""
    k: torch.Tensor | None = None                # [capacity, KV, D]
    v: torch.Tensor | None = None
    n: int = 0
    # when a dict, the attention leaves this call's q, k, v (roped) and per-head outputs o in it
    capture: dict | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add rows [T,KV,D]; returns views of all rows so far [n,KV,D]."""
        need = self.n + k.shape[0]
        if self.k is None or need > self.k.shape[0]:
            cap = max(need, 2 * (0 if self.k is None else self.k.shape[0]), 256)
            nk = k.new_empty((cap,) + k.shape[1:])
            nv = v.new_empty((cap,) + v.shape[1:])
            if self.n:
                nk[:self.n], nv[:self.n] = self.k[:self.n], self.v[:self.n]
            self.k, self.v = nk, nv
        self.k[self.n:need], self.v[self.n:need] = k, v
        self.n = need
        return self.k[:need], self.v[:need]


@dataclass
class KVCache:
    layers: list[LayerCache]
    pos: int = 0                                 # rows held = position of the next token


# ============================================================================ blocks

class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, rotary: Rotary, dtype: torch.dtype, q_chunk: int):
        super().__init__()
        d, H, KV, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.layer, self.n_heads, self.n_kv_heads, self.head_dim = layer, H, KV, D
        self.scale, self.q_chunk, self.rotary = D ** -0.5, q_chunk, rotary
        self.q_proj = nn.Linear(d, H * D, bias=cfg.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(d, KV * D, bias=cfg.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(d, KV * D, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(H * D, d, bias=cfg.o_bias, dtype=dtype)

    # -- pieces reused by the reuse engine -----------------------------------------------------
    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T,d] (already normed) -> q [T,H,D] and k [T,KV,D] roped at `positions`, v [T,KV,D]."""
        T, D = x.shape[0], self.head_dim
        q = self.q_proj(x).view(T, self.n_heads, D)
        k = self.k_proj(x).view(T, self.n_kv_heads, D)
        v = self.v_proj(x).view(T, self.n_kv_heads, D)
        cos, sin = self.rotary.cos_sin(positions)
        return Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin), v

    def attend(self, q, k, v, q_pos=None, k_pos=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend` with this layer's scale and query chunk."""
        return attend(q, k, v, q_pos, k_pos, self.scale, self.q_chunk)

    def project(self, o: torch.Tensor, heads: slice | torch.Tensor | None = None) -> torch.Tensor:
        """W_o: per-head outputs o [T,H,D] -> [T,d]. With `heads` (a slice, head indices, or a bool mask [H]),
        o holds only those heads [T,h,D] in that order and only their input channels of o_proj are used,
        without the bias: projections of disjoint head sets sum to the full projection less its bias."""
        T, D = o.shape[0], self.head_dim
        w = self.o_proj.weight                                              # [d, H*D]
        if heads is None:
            assert o.shape[1] == self.n_heads, f"o has {o.shape[1]} heads, layer has {self.n_heads}"
            return F.linear(o.reshape(T, -1).to(w.dtype), w, self.o_proj.bias)
        if isinstance(heads, slice):
            a, b, step = heads.indices(self.n_heads)
            assert step == 1, f"heads {heads}: step must be 1"
            w_h = w[:, a * D:b * D]
        else:
            idx = torch.as_tensor(heads, device=w.device)
            idx = idx.nonzero().flatten() if idx.dtype == torch.bool else idx
            w_h = w.view(w.shape[0], self.n_heads, D)[:, idx].reshape(w.shape[0], -1)
        assert w_h.shape[1] == o.shape[1] * D, f"heads {heads} select {w_h.shape[1] // D}, o has {o.shape[1]}"
        return F.linear(o.reshape(T, -1).to(w.dtype), w_h)

    # -- full forward --------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        q, k, v = self.qkv(x, positions)
        keys, values = cache.append(k, v)
        if x.shape[0] == 1:                     # one row after everything cached (decode) sees every key: no mask
            o, _ = self.attend(q, keys, values)
        else:
            k_pos = torch.arange(keys.shape[0], device=x.device)
            o, _ = self.attend(q, keys, values, positions, k_pos)
        if cache.capture is not None:
            cache.capture.update(q=q, k=k, v=v, o=o)
        return self.project(o)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=cfg.mlp_bias, dtype=dtype)
        self.up_proj = nn.Linear(d, f, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, rotary: Rotary, dtype: torch.dtype, q_chunk: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer, rotary, dtype, q_chunk)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), positions, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


# ============================================================================ the model

class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype = torch.float32, q_chunk: int = 1024):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.rotary = Rotary(rope_inv_freq(cfg))                        # one table, shared by every layer
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary, dtype, q_chunk)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                      dtype=dtype)

    def new_cache(self) -> KVCache:
        return KVCache([LayerCache() for _ in range(self.cfg.num_hidden_layers)])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on hidden rows [T,d] -> float32 logits [T,V]."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(h), w).float()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, all_logits: bool = False) -> torch.Tensor:
        """Run `tokens` [T] after what `cache` already holds (prefill when it is empty). Returns float32
        logits of the last row [V], or of every row [T,V]."""
        cache = cache if cache is not None else self.new_cache()
        T = tokens.shape[0]
        positions = torch.arange(cache.pos, cache.pos + T, device=tokens.device)
        x = self.embed(tokens)
        for layer, lc in zip(self.layers, cache.layers):
            x = layer(x, positions, lc)
        cache.pos += T
        return self.logits(x) if all_logits else self.logits(x[-1:])[0]

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """One new row for each of B requests (tokens [B]), request b's after what caches[b] holds: [B, V]. The
        same call as DeepSeek-V4's batched step (the worker's decode round); here each request's row runs its own
        forward (a model of this size is bound by launches, not by the batch)."""
        return torch.stack([self.forward(t[None], c) for t, c in zip(tokens, caches)])

    @torch.inference_mode()
    def forward_packed(self, tokens: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Independent sequences packed into one forward (each at positions 0..n-1, a block-diagonal causal
        mask): equals running each alone up to rounding, in one pass of the layers. Returns per layer the
        packed (k [N,KV,D] roped, v [N,KV,D], per-head outputs o [N,H,D]), sequences in order."""
        dev = self.embed_tokens.weight.device
        positions = torch.tensor([j for t in tokens for j in range(len(t))], device=dev)
        seg = torch.tensor([i for i, t in enumerate(tokens) for _ in t], device=dev)
        x = self.embed(torch.tensor([j for t in tokens for j in t], device=dev))
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), positions)
            o, _ = attend(q, k, v, positions, positions, attn.scale, attn.q_chunk, seg, seg)
            out.append((k, v, o))
            h = x + attn.project(o)
            x = h + layer.mlp(layer.post_attention_layernorm(h))
        return out

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, cache: KVCache, chunk: int | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Extend the cache by `tokens` in chunks; chunked prefill equals one-shot prefill."""
        chunk = chunk or max(tokens.shape[0], 1)
        outs = [self.forward(tokens[a:a + chunk], cache, all_logits) for a in range(0, tokens.shape[0], chunk)]
        return torch.cat(outs) if all_logits else outs[-1]

    @torch.inference_mode()
    def greedy_many(self, caches: list[KVCache], logits: list[torch.Tensor], max_new_tokens: int,
                    stop: set[int]) -> list[list[int]]:
        """Greedy decoding of several requests of equal length at once (one batched step for all, one host sync
        a step): request b continues `caches[b]` from its next-token `logits[b]` [V] and stops before a token
        in `stop` or after max_new_tokens. Equals decoding each on its own (`forward` a token at a time) up
        to rounding. The caches are not extended (their rows are copied into one batched buffer)."""
        kb, vb = self.batched_cache(caches, max_new_tokens)
        n, B = caches[0].pos, len(caches)
        fused = self.fused_weights()
        cur = torch.stack(logits)                                              # [B, V]
        out: list[list[int]] = [[] for _ in range(B)]
        live = [True] * B
        for step in range(max_new_tokens):
            nxt = cur.argmax(-1).tolist()
            for b in range(B):
                if live[b] and nxt[b] in stop:
                    live[b] = False
                elif live[b]:
                    out[b].append(nxt[b])
            if not any(live) or step == max_new_tokens - 1:
                break
            cur = self._decode_step(torch.tensor(nxt, device=cur.device), kb, vb, n + step, fused)
        return out

    def batched_cache(self, caches: list[KVCache], room: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer the caches' rows stacked as [B, KV, n + room, D] (head-major: each step's attention is
        two batched matmuls over (request, KV head) with no copy of the keys); rows past n are zero."""
        n = caches[0].pos
        assert all(c.pos == n for c in caches), f"requests of unequal length {[c.pos for c in caches]}"
        kb, vb = [], []
        for i in range(len(self.layers)):
            for buf, part in ((kb, "k"), (vb, "v")):
                rows = torch.stack([getattr(c.layers[i], part)[:n] for c in caches]).transpose(1, 2)
                b = rows.new_zeros(rows.shape[:2] + (n + room,) + rows.shape[3:])
                b[:, :, :n] = rows
                buf.append(b)
        return kb, vb

    def fused_weights(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer W_q|W_k|W_v and W_gate|W_up (and their biases) concatenated by output rows, for the
        batched decode step (three and two matmuls become one each). Built per call: never stale."""
        out = []
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            b = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            gu = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
            out.append((w, b, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gu))
        return out

    def _decode_step(self, tokens: torch.Tensor, kb: list[torch.Tensor], vb: list[torch.Tensor], pos: int,
                     fused: list) -> torch.Tensor:
        """One token [B] per request at position `pos` on batched caches kb/vb [B, KV, capacity, D] (rows
        0..pos-1 filled; row pos written here) with `fused_weights`. Every cached row is visible: no mask.
        The same arithmetic as `forward` of one row per request, up to rounding. -> logits [B, V]."""
        B, H, KV, D = tokens.shape[0], self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        positions = torch.full((B,), pos, device=tokens.device)
        x = self.embed(tokens)
        for layer, k_all, v_all, (w_qkv, b_qkv, w_gu, b_gu) in zip(self.layers, kb, vb, fused):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = F.linear(layer.input_layernorm(x), w_qkv, b_qkv).view(B, H + 2 * KV, D)
            qk = self.rotary.rotate(qkv[:, :H + KV], positions)                # q and k heads turned at once
            k_all[:, :, pos], v_all[:, :, pos] = qk[:, H:], qkv[:, H + KV:]
            keys, values = k_all[:, :, :pos + 1], v_all[:, :, :pos + 1]       # [B, KV, pos+1, D]
            q = qk[:, :H].reshape(B, KV, H // KV, D).float()
            s = torch.matmul(q, keys.float().transpose(-1, -2)) * attn.scale  # [B, KV, G, pos+1]
            o = torch.matmul(torch.softmax(s, dim=-1).to(values.dtype), values)
            h = x + attn.project(o.reshape(B, H, D))
            gate, up = F.linear(layer.post_attention_layernorm(h), w_gu, b_gu).chunk(2, dim=-1)
            x = h + mlp.down_proj(F.silu(gate) * up)
        return self.logits(x)

    @torch.inference_mode()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, chunk: int | None = None,
                 eos: int | tuple[int, ...] | None = None) -> tuple[list[int], KVCache]:
        """Greedy decoding; stops after an end token (the config's when None, emitted and included) or after
        max_new_tokens. Returns the new tokens and the cache (prompt + all but the last new token)."""
        stop = set(self.cfg.eos_token_ids if eos is None else ((eos,) if isinstance(eos, int) else eos))
        cache = self.new_cache()
        logits = self.prefill(tokens, cache, chunk)
        out: list[int] = []
        for i in range(max_new_tokens):
            nxt = int(logits.argmax())
            out.append(nxt)
            if nxt in stop or i == max_new_tokens - 1:
                break
            logits = self.forward(torch.tensor([nxt], device=tokens.device), cache)
        return out, cache
