"""DeepSeek-V4, written top-down in paper order with the paper's (and the reference's) names.

One file: rotary embedding (YaRN in compressed layers only), the attention block (low-rank q, per-head
weightless RMS norm, one shared 512-d K=V latent, 128-token window, CSA compressor with overlapping
blocks and the lightning indexer, HCA compressor, per-head sink, inverse output RoPE, grouped W_a then
W_b), the MoE (sqrt-softplus gate with a selection-only bias, hash routing in the first layers, shared
expert, SwiGLU clamp), the mHC residual (4 streams, Sinkhorn) and the hyper head.

Parameter names equal the official checkpoint's, so `state_dict()` keys are the names on disk.
Shapes: T = rows in this call, H = local heads, D = head_dim, d = model dim, N = compressed entries.
Batch size is one request; a serving batch is a list of requests.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

import runtime.kernels as K        # `K.enabled` etc. read at call time: the one switch, patched by the CPU tests
from runtime.kernels import f32linear, mhc, rmsnorm, swiglu
from runtime.kernels.reference import (NEG_INF, _lse_attend, entry_attention, gathered_attention,  # noqa: F401
                                       swiglu_activation, unweighted_rms_norm_reference, weighted_rms_norm)
from runtime.kernels.rope import rope_
from runtime.policy import DEFAULT_POLICY, RuntimePolicy
from .config import CSA, HCA, WINDOW, ModelConfig
from .parallel import Parallel



def phase(name: str):
    """A profiler label (bench/ttft.py --profile-at, bench/gaps.py): torch.profiler.record_function while a profiler
    runs, else nothing. Entering record_function is a dispatcher call even when no profiler runs (several
    microseconds), and the reuse arm enters tens a layer."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


# ============================================================================ norms and rotary

class RMSNorm(nn.Module):
    """Weighted RMS norm; the weight is kept in float32 like the reference and the product is cast once."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if K.enabled(x) and rmsnorm.supported(x, self.weight):      # the same arithmetic in one pass
            return rmsnorm.rms_norm(x, self.weight, self.eps)
        return weighted_rms_norm(x, self.weight, self.eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-head query norm: on CUDA (runtime.kernels.enabled) the one-pass kernel, else the torch form."""
    if K.enabled(x) and rmsnorm.supported(x, None):                  # the same arithmetic in one pass
        return rmsnorm.rms_norm(x, None, eps)
    return unweighted_rms_norm_reference(x, eps)


def yarn_inv_freq(dim: int, base: float, factor: float, original_seq_len: int,
                  beta_fast: float, beta_slow: float) -> torch.Tensor:
    """Inverse frequencies of one rotary pair per entry; YaRN blends interpolation and extrapolation over
    the dims whose wavelength crosses the original context (correction range floored/ceiled)."""
    # built on the CPU explicitly, also when the model is constructed under a meta-device context
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrap = 1.0 / pos_freqs
    if factor <= 1.0 or original_seq_len <= 0:
        return extrap
    interp = 1.0 / (factor * pos_freqs)

    def corr_dim(n_rot: float) -> float:
        return dim * math.log(original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep_extrap = 1 - ramp
    return interp * (1 - keep_extrap) + extrap * keep_extrap


class _SharedAngles:
    """What `shared_angles` keeps for one scope: position tensors by id (held, so an id is never reused while the
    scope lasts) with their version counters (None for inference tensors, which keep none), and their cos/sin per
    rotary frequency set."""

    def __init__(self):
        self.positions: dict[int, tuple[torch.Tensor, int]] = {}
        self.ranges: dict[tuple, torch.Tensor] = {}
        self.angles: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


_SHARED_ANGLES: contextvars.ContextVar[_SharedAngles | None] = contextvars.ContextVar("redknot_shared_angles",
                                                                                        default=None)


@contextlib.contextmanager
def shared_angles():
    """A scope (one reuse prefill) in which `Rotary.cos_sin` of a position tensor made by `shared_arange` or
    registered by `share_positions` is computed once per set of inverse frequencies and handed to every later
    call with the same tensor, unchanged since (its version counter): the reusable layers rotate the same position
    sets layer after layer, and every compressed layer has the same frequencies (as every window layer has).
    Bitwise the same angles; only their recomputation (four launches a call) is saved. The callers only read the
    returned tensors (RoPE takes them read-only), and a registered tensor is not changed in place (a change is
    noticed through the version counter, which inference-mode tensors do not keep). Outside a scope nothing is
    kept."""
    token = _SHARED_ANGLES.set(_SharedAngles())
    try:
        yield
    finally:
        _SHARED_ANGLES.reset(token)


def share_positions(positions: torch.Tensor) -> torch.Tensor:
    """Registers `positions` in the current `shared_angles` scope (none: does nothing); returns it."""
    scope = _SHARED_ANGLES.get()
    if scope is not None:
        scope.positions[id(positions)] = (positions, _version(positions))
    return positions


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


def shared_arange(start: int, end: int, step: int = 1, device=None) -> torch.Tensor:
    """torch.arange(start, end, step) (int64); inside a `shared_angles` scope one registered tensor per
    (start, end, step, device), so its angles are computed once."""
    scope = _SHARED_ANGLES.get()
    if scope is None:
        return torch.arange(start, end, step, device=device)
    key = (start, end, step, str(torch.device(device) if device is not None else "cpu"))
    t = scope.ranges.get(key)
    if t is None or _version(t) != scope.positions.get(id(t), (None, -1))[1]:
        t = scope.ranges[key] = share_positions(torch.arange(start, end, step, device=device))
    return t


class Rotary(nn.Module):
    """Interleaved RoPE on the trailing `rope_head_dim` channels (pairs 2i, 2i+1)."""

    def __init__(self, inv_freq: torch.Tensor):
        super().__init__()
        # a plain attribute, not a buffer: derived from the config, never loaded, moved on first use
        self.inv_freq = inv_freq
        # the frequencies' values (built on the CPU): rotaries with equal ones share angles (`shared_angles`)
        self._freq_key = tuple(inv_freq.tolist())

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scope = _SHARED_ANGLES.get()
        if scope is not None:
            held = scope.positions.get(id(positions))
            if held is not None and held[0] is positions and held[1] == _version(positions):
                key = (self._freq_key, id(positions))
                got = scope.angles.get(key)
                if got is None:
                    got = scope.angles[key] = self._cos_sin(positions)
                return got
        return self._cos_sin(positions)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [T, ..., D]; cos/sin [T, rd/2]. Inverse rotation is the conjugate (-sin). On the kernel path
        (runtime.kernels.enabled) two launches: the other channels copied, the rope channels turned by
        `runtime.kernels.rope.rope_` (the same float32 arithmetic), instead of about ten elementwise ops and a
        concatenation."""
        rd = cos.shape[-1] * 2
        if (K.enabled(x) and x.dim() >= 2 and x.numel() and cos.shape[0] == x.shape[0] and x.stride(-1) == 1
                and cos.dtype == sin.dtype == torch.float32 and (rd // 2 & (rd // 2 - 1)) == 0):
            T, D = x.shape[0], x.shape[-1]
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            out[..., :-rd].copy_(x[..., :-rd])
            rope_(out.view(T, -1, D), cos, sin, inverse, src=x.reshape(T, -1, D))
            return out
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        c, s = cos.view(shape), sin.view(shape)
        if inverse:
            s = -s
        rope = x[..., -rd:].float()
        xe, xo = rope[..., 0::2], rope[..., 1::2]
        rot = torch.stack((xe * c - xo * s, xo * c + xe * s), dim=-1).flatten(-2)
        return torch.cat([x[..., :-rd], rot.to(x.dtype)], dim=-1)


# ============================================================================ linear layers

class Linear(nn.Linear):
    """nn.Linear without bias. `fp8_act` marks the layers whose activations the reference quantizes to FP8
    (1x128 blocks); the simulation runs only when the config's `quant_sim` switch is on."""

    def __init__(self, d_in: int, d_out: int, dtype: torch.dtype, fp8_act: bool = False, quant_sim: bool = False):
        super().__init__(d_in, d_out, bias=False, dtype=dtype)
        self.simulate = fp8_act and quant_sim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.simulate:
            from .quant import fake_quant_fp8_act
            x = fake_quant_fp8_act(x)
        return F.linear(x.to(self.weight.dtype), self.weight)


# ============================================================================ cache

@dataclass
class CompressorState:
    """Incomplete tail block (pre-gate rows), the previous block's overlap half (CSA) and all entries."""
    tail_kv: torch.Tensor | None = None
    tail_gate: torch.Tensor | None = None
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None

    @property
    def n_entries(self) -> int:
        return 0 if self.entries is None else self.entries.shape[0]


@dataclass
class LayerCache:
    window_kv: torch.Tensor | None = None        # last window-1 latent rows [<=W-1, D]
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)   # CSA: compressed indexer keys
    # when a dict, the attention leaves this call's latent rows, per-head outputs and indexer picks in it
    # (the reuse producer and the consumer's fences read them)
    capture: dict | None = None


@dataclass
class ModelCache:
    layers: list[LayerCache]
    pos: int = 0


# ============================================================================ attention pieces

def window_attention(q: torch.Tensor, keys: torch.Tensor, n_past: int, window: int, scale: float):
    """q [T,H,D]; keys [n_past+T, D] where query t sits at key row n_past+t and sees rows
    (n_past+t-window, n_past+t]. Each query gathers exactly `window` rows (no masked waste beyond the edge)."""
    T = q.shape[0]
    rows = torch.arange(T, device=q.device)[:, None] + n_past - window + 1 + torch.arange(window, device=q.device)
    valid = rows >= 0
    k = keys[rows.clamp(min=0)]                                          # [T, W, D]
    s = torch.einsum("thd,twd->thw", q, k).float() * scale
    s = s.masked_fill(~valid[:, None, :], NEG_INF)
    return _lse_attend(s, k, "thw,twd->thd")


def merge_with_sink(parts: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor) -> torch.Tensor:
    """N-way log-sum-exp merge of partial outputs [T,H,D] with LSEs [T,H]; the sink's exp(sink) joins the
    denominator once, after the merge."""
    lses = torch.stack([lse for _, lse in parts] + [sink.float()[None, :].expand_as(parts[0][1])], dim=0)
    total = torch.logsumexp(lses, dim=0)                                 # [T, H]
    out = torch.zeros_like(parts[0][0], dtype=torch.float32)
    for o, lse in parts:
        w = torch.exp(lse - total)                                       # exp(-inf) = 0 for empty parts
        out = out + w.unsqueeze(-1) * o.float()
    return out


# ============================================================================ compressors

class Compressor(nn.Module):
    """Gated pooling of `ratio` consecutive rows into one entry, blocks aligned to absolute positions.
    With `overlap` (CSA) each row projects two series: Ca (first half) feeds the NEXT block's entry and Cb
    (second half) its own, so an entry pools 2*ratio rows with stride ratio. The entry is RMS-normed and
    carries RoPE at its block's first position."""

    def __init__(self, cfg: ModelConfig, ratio: int, dim: int, rotary: Rotary, dtype: torch.dtype):
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, ratio == 4
        width = dim * (2 if self.overlap else 1)
        # The reference keeps the compressor projections in float32.
        self.wkv = Linear(cfg.dim, width, torch.float32)
        self.wgate = Linear(cfg.dim, width, torch.float32)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, cfg.norm_eps)
        self.rotary = rotary
        self.out_dtype = dtype

    def forward(self, x: torch.Tensor, state: CompressorState) -> torch.Tensor:
        """Feed rows x [T,d] (the next rows after everything already fed); returns all entries [N, dim]."""
        kv, gate = self.project(x)
        if state.tail_kv is not None:
            kv, gate = torch.cat([state.tail_kv, kv]), torch.cat([state.tail_gate, gate])
        r, D = self.ratio, self.dim
        nb = kv.shape[0] // r
        first = state.n_entries * r
        state.tail_kv, state.tail_gate = kv[nb * r:], gate[nb * r:]
        if nb == 0:
            if state.entries is None:
                state.entries = x.new_zeros((0, D), dtype=self.out_dtype)
            return state.entries
        ck = kv[: nb * r].view(nb, r, -1)
        cg = gate[: nb * r].view(nb, r, -1) + self.ape
        prev_kv = prev_gate = None
        if self.overlap:     # each block's previous block's Ca half; the first block's from the state, if any
            if state.prev_kv is not None:
                kv0, gate0 = state.prev_kv.to(ck.dtype)[None], state.prev_gate.to(cg.dtype)[None]
            else:
                kv0, gate0 = ck.new_zeros((1, r, D)), cg.new_full((1, r, D), NEG_INF)   # weight 0: none
            prev_kv, prev_gate = torch.cat([kv0, ck[:-1, :, :D]]), torch.cat([gate0, cg[:-1, :, :D]])
            state.prev_kv, state.prev_gate = ck[-1, :, :D].clone(), cg[-1, :, :D].clone()
        pos = shared_arange(first, first + r * nb, r, device=x.device)
        pooled = self.pool(ck, cg, prev_kv, prev_gate, pos)
        state.entries = pooled if state.entries is None else torch.cat([state.entries, pooled])
        return state.entries

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row compressor inputs: (kv, gate) [T, width] in float32, gate without the position bias. On CUDA with
        bf16 rows, the same float32 products on the tensor cores (runtime/kernels/f32linear.py)."""
        if K.enabled(x) and f32linear.supported(x, self.wkv.weight, self.wgate.weight):
            return f32linear.linear_f32(x, self.wkv.weight, self.wgate.weight)
        xf = x.float()
        return self.wkv(xf), self.wgate(xf)

    def pool(self, ck, cg, prev_kv, prev_gate, pos) -> torch.Tensor:
        """Blocks ck/cg [nb, r, width] (gate with ape added) -> entries [nb, dim] with RoPE at `pos`.
        With overlap, prev_kv/prev_gate [nb, r, dim] are each block's previous block's Ca half (-inf gate
        where there is none)."""
        D = self.dim
        if self.overlap:
            ck = torch.cat([prev_kv, ck[..., D:]], dim=1)
            cg = torch.cat([prev_gate, cg[..., D:]], dim=1)
        pooled = self.norm((ck * cg.softmax(dim=1)).sum(dim=1))
        return Rotary.apply(pooled, *self.rotary.cos_sin(pos)).to(self.out_dtype)


class Indexer(nn.Module):
    """Lightning indexer: score(t, s) = sum_h w[t,h] * ReLU(q[t,h] . K[s]) over its own compressed keys;
    each query keeps the top-k entries among the blocks complete before it."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype, fp8_act=True,
                           quant_sim=cfg.quant_sim)
        self.weights_proj = Linear(cfg.dim, self.n_heads, dtype)
        self.compressor = Compressor(cfg, 4, self.head_dim, rotary, dtype)
        self.rotary = rotary

    def scores(self, x, qr, positions, keys) -> torch.Tensor:
        """[T, N] indexer scores with non-causal entries at -inf."""
        return self.scores_from(*self.query(x, qr), positions, keys)

    def query(self, x, qr) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries before RoPE [T, heads, dim] and raw head weights [T, heads] (float32): what does not
        depend on the query's position, so the reuse consumer computes it once for every segment's frame."""
        return self.wq_b(qr).view(x.shape[0], self.n_heads, self.head_dim), self.weights_proj(x).float()

    def scores_from(self, q, w_raw, positions, keys) -> torch.Tensor:
        """`scores` from `query`'s outputs, the query roped at `positions`."""
        return self.scores_roped(Rotary.apply(q, *self.rotary.cos_sin(positions)), w_raw, positions, keys)

    def head_weights(self, q, w_raw) -> torch.Tensor:
        """The scaled head weights `scores_roped` applies to queries `q` (the kernel path scales the dot products
        by head_dim^-0.5 itself): a caller scoring the same rows against several key sets computes them once."""
        return w_raw * (self.n_heads ** -0.5 if K.enabled(q) else self.n_heads ** -0.5 * self.head_dim ** -0.5)

    def scores_roped(self, q, w_raw, positions, keys, out: torch.Tensor | None = None,
                     w: torch.Tensor | None = None) -> torch.Tensor:
        """`scores_from` with the query already roped at `positions`; written into `out` (a float32 [T, N] view
        with unit column stride, e.g. a column slice of a wider score block) when given. `w`: `head_weights(q,
        w_raw)` already computed (w_raw is then not read)."""
        w = self.head_weights(q, w_raw) if w is None else w
        if K.enabled(q):
            return K.indexer_scores(q, keys.to(q.dtype), w, positions, out=out)
        # in the activation dtype (the reference runs this in FP8), ReLU in place, heads reduced by a batched
        # matvec: the [T, heads, N] block is written once and read once
        s = torch.relu_(torch.einsum("thd,nd->thn", q, keys.to(q.dtype)))
        s = torch.einsum("thn,th->tn", s, w.to(s.dtype)).float()
        ready = (positions + 1) // 4                                    # entries complete before t
        s = s.masked_fill(torch.arange(keys.shape[0], device=q.device)[None, :] >= ready[:, None], NEG_INF)
        return s if out is None else out.copy_(s)

    def forward(self, x, qr, positions, state: CompressorState, q_chunk: int, start: int = 0) -> torch.Tensor:
        """Top-k entry ids [T - start, k'] (k' = min(topk, N)); -1 where fewer entries are ready. Every row of x
        feeds the compressed keys (the cache's state); only rows start.. are scored (qr holds those rows only)."""
        keys = self.compressor(x, state)
        x, positions = x[start:], positions[start:]
        k = min(self.topk, keys.shape[0])
        if k == 0 or x.shape[0] == 0:
            return torch.full((x.shape[0], k), -1, dtype=torch.long, device=x.device)
        # the [rows, heads, N] score block is the indexer's largest temporary: bound it to ~2^28 elements
        q_chunk = max(1, min(q_chunk, (1 << 28) // (self.n_heads * keys.shape[0])))
        if K.enabled(x):
            q = Rotary.apply(self.wq_b(qr).view(x.shape[0], self.n_heads, self.head_dim),
                             *self.rotary.cos_sin(positions))
            w = self.weights_proj(x).float() * self.n_heads ** -0.5
            return K.indexer_topk(q, keys.to(q.dtype), w, positions, k)[0]
        out = []
        for a in range(0, x.shape[0], q_chunk):
            b = min(a + q_chunk, x.shape[0])
            # entries no query of this chunk can see are not scored at all (positions increase within a call)
            n_ready = min(keys.shape[0], int(positions[b - 1].item() + 1) // 4)
            idx = torch.full((b - a, k), -1, dtype=torch.long, device=x.device)
            if n_ready:
                top = self.scores(x[a:b], qr[a:b], positions[a:b], keys[:n_ready]).topk(min(k, n_ready), dim=-1)
                idx[:, :top.indices.shape[1]] = torch.where(torch.isinf(top.values),
                                                            torch.full_like(top.indices, -1), top.indices)
            out.append(idx)
        return torch.cat(out)


# ============================================================================ attention

def grouped_projection(o: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                       add: bool = True) -> torch.Tensor:
    """Each group's block of W_a: o [T, G, i], w [G, R, i] -> [T, G*R] with columns g*R..(g+1)*R = o[:, g] @ w[g]^T.
    One batched GEMM over strided views (the groups are the batch): o and w are read where they lie and the result
    is written in its [T, G*R] layout, where an einsum permutes its result and copies it. With `out` [T, G*R]
    given, the products are added to it inside the same GEMM (beta = 1: the sum is rounded once) and out is
    returned; with `add` False they are written into it (beta = 0: its contents are never read)."""
    T, G, _ = o.shape
    R = w.shape[1]
    beta = 1.0 if add else 0.0
    if out is None:     # beta = 0: the empty tensor's contents are never read (nor a NaN in them propagated)
        out, beta = torch.empty((T, G * R), dtype=o.dtype, device=o.device), 0.0
    assert out.shape == (T, G * R) and out.is_contiguous(), (out.shape, T, G, R)
    if T:
        out.view(T, G, R).transpose(0, 1).baddbmm_(o.transpose(0, 1), w.transpose(1, 2), beta=beta)
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, par: Parallel, dtype: torch.dtype):
        super().__init__()
        assert cfg.o_groups % par.size == 0, f"o_groups={cfg.o_groups} not divisible by tp={par.size}"
        self.cfg, self.layer, self.par = cfg, layer, par
        self.kind = cfg.layer_kind(layer)
        self.ratio = cfg.compress_ratios[layer]
        self.n_groups = cfg.o_groups // par.size                       # whole output groups per rank
        self.n_heads = self.n_groups * cfg.heads_per_group
        D, qs = cfg.head_dim, cfg.quant_sim
        self.scale = D ** -0.5
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, dtype, fp8_act=True, quant_sim=qs)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * D, dtype, fp8_act=True, quant_sim=qs)
        self.wkv = Linear(cfg.dim, D, dtype, fp8_act=True, quant_sim=qs)
        self.kv_norm = RMSNorm(D, cfg.norm_eps)
        self.wo_a = Linear(cfg.heads_per_group * D, self.n_groups * cfg.o_lora_rank, dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank // par.size, cfg.dim, dtype, fp8_act=True, quant_sim=qs)
        if self.kind == WINDOW:
            inv = yarn_inv_freq(cfg.rope_head_dim, cfg.rope_theta, 1.0, 0, cfg.beta_fast, cfg.beta_slow)
        else:
            inv = yarn_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.rope_factor,
                                cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow)
        self.rotary = Rotary(inv)
        self.compressor = Compressor(cfg, self.ratio, D, self.rotary, dtype) if self.ratio else None
        self.indexer = Indexer(cfg, self.rotary, dtype) if self.kind == CSA else None

    # -- pieces reused by the reuse engine -----------------------------------------------------
    def queries(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T,d] -> (q [T,H,D] normed and roped, qr [T,q_lora_rank])."""
        qr = self.q_norm(self.wq_a(x))
        return self.queries_from(qr, positions), qr

    def queries_from(self, qr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The normed, roped per-head queries [T,H,D] of `queries` from its low-rank qr [T, q_lora_rank]; row-wise,
        so the forward computes them one query chunk at a time."""
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.cfg.head_dim)
        q = unweighted_rms_norm(q, self.cfg.norm_eps)
        return Rotary.apply(q, *self.rotary.cos_sin(positions))

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The one K=V row per token [T, D], RoPE on its last rope_head_dim channels."""
        kv = self.kv_norm(self.wkv(x))
        return Rotary.apply(kv, *self.rotary.cos_sin(positions))

    def project(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Per-head outputs [T,H,D] -> projected state P [T, G_local*o_lora_rank]: inverse RoPE at the query
        position (so the output depends on relative positions only), then each group's block of W_a."""
        return self.project_relative(Rotary.apply(o, *self.rotary.cos_sin(positions), inverse=True))

    def project_relative(self, o: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`project` on outputs whose inverse RoPE is already applied (the reuse consumer de-rotates each segment's
        partial output at its own shifted query position): each group's block of W_a (written into `out`, given)."""
        T, G, R = o.shape[0], self.n_groups, self.cfg.o_lora_rank
        return grouped_projection(o.reshape(T, G, -1).to(self.wo_a.weight.dtype), self.wo_a.weight.view(G, R, -1),
                                  out, add=False)

    def output(self, p: torch.Tensor) -> torch.Tensor:
        """W_b once, row-parallel: one all-reduce."""
        return self.par.all_reduce(self.wo_b(p))

    # -- one request's keys and attention (the full forward and the batched decode step) --------------
    def _extend(self, x, kv, qr, positions, cache: LayerCache, q_chunk: int, a0: int = 0):
        """Rows x [T,d] (latent kv [T,D]) appended to `cache`: its window, compressed entries and indexer keys.
        Returns (keys [n_past+T, D]: the window's past rows then these, n_past, the entries or None, the indexer's
        picks for rows a0.. or None; qr holds rows a0.. only)."""
        past = cache.window_kv
        keys = kv if past is None else torch.cat([past, kv])
        n_past = 0 if past is None else past.shape[0]
        W = self.cfg.window_size
        cache.window_kv = keys[-(W - 1):].clone() if W > 1 else keys[:0].clone()
        entries = self.compressor(x, cache.compressor) if self.compressor is not None else None
        idx = self.indexer(x, qr, positions, cache.indexer, q_chunk, start=a0) if self.indexer is not None else None
        return keys, n_past, entries, idx

    def _attend(self, q, keys, first: int, positions, entries, picks, fast: bool, shift: int) -> torch.Tensor:
        """Outputs [t,H,D] (float32 on the reference path) of queries q [t,H,D] sitting at key rows first.. and
        at `positions`: the window over `keys`, the entries (HCA: those complete before each query; CSA: its
        indexer `picks`), the sink in the merge. `shift`: positions minus key rows (the kernel's HCA visibility)."""
        W = self.cfg.window_size
        if fast:   # one fused pass over window rows and entries; the sink joins in the merge
            mode = {WINDOW: "none", HCA: "causal", CSA: "picks"}[self.kind]
            cpos = torch.arange(first, first + q.shape[0], device=q.device)
            part = K.sparse_mqa_attention(q, keys, cpos, W, entries, mode, self.ratio or 1, picks, self.scale,
                                          pos_shift=shift)
            return merge_with_sink([part], self.attn_sink)
        parts = [window_attention(q, keys, first, W, self.scale)]
        if self.kind == HCA:
            visible = torch.arange(entries.shape[0], device=q.device)[None, :] < \
                ((positions + 1) // self.ratio)[:, None]
            parts.append(entry_attention(q, entries, visible, self.scale))
        elif self.kind == CSA:
            parts.append(gathered_attention(q, entries, picks, self.scale))
        return merge_with_sink(parts, self.attn_sink)

    def decode(self, x: torch.Tensor, positions: torch.Tensor, at: list[int], caches: list[LayerCache]) -> torch.Tensor:
        """One new row for each of B requests: x [B,d] at `positions` [B] (the same as host ints `at`), request b's
        row after what caches[b] holds. The row-wise work (W_q, the latent, W_a, W_b) runs once for the batch;
        each request's cache update, indexer picks and attention run on its own cache. Equal to B one-row
        forwards."""
        qr = self.q_norm(self.wq_a(x))
        kv = self.latent(x, positions)
        q = self.queries_from(qr, positions)
        fast = K.enabled(x)
        o = torch.empty((x.shape[0], self.n_heads, self.cfg.head_dim), dtype=x.dtype, device=x.device)
        for b, cache in enumerate(caches):
            if cache.capture is not None:
                raise ValueError("a batched decode step captures no layer outputs")
            rows = slice(b, b + 1)
            keys, n_past, entries, idx = self._extend(x[rows], kv[rows], qr[rows], positions[rows], cache, 1)
            shift = at[b] - n_past if fast and self.kind == HCA else 0
            o[rows] = self._attend(q[rows], keys, n_past, positions[rows], entries, idx, fast, shift)
        return self.output(self.project(o, positions))

    # -- full forward --------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache, q_chunk: int,
                out_rows: int | None = None) -> torch.Tensor:
        """Queries, attention and W_a run one chunk of q_chunk rows at a time: the per-head tensors [rows, H, D]
        (queries, outputs, their float32 temporaries) never exist for the whole request (at 128K tokens and
        H x D = 64 x 512 each would be 8-17 GB); only the projected state [T, G*R] does. Rows are independent
        in all three, so the result is the same as one pass. The producer (cache.capture) keeps every row's
        output, as before.

        `out_rows`: only the last out_rows rows' outputs are computed and returned ([out_rows, d]); every row
        still feeds the cache (latent, window, compressed entries, the indexer's keys), so the cache is the one
        a full pass leaves. The model's last layer needs no more for the next token (`Transformer.forward`)."""
        T = x.shape[0]
        a0 = 0 if out_rows is None else max(T - int(out_rows), 0)
        qr = self.q_norm(self.wq_a(x[a0:]))
        kv = self.latent(x, positions)
        keys, n_past, entries, idx = self._extend(x, kv, qr, positions, cache, q_chunk, a0)
        fast = K.enabled(x)
        # the kernel sees key rows; HCA's entry visibility needs positions, which differ from key rows whenever the
        # cache keeps only the window's last rows (decoding, the reuse arm's fence layers): one sync per HCA call
        shift = int(positions[0]) - n_past if fast and self.kind == HCA and T else 0
        n_out = T - a0                                   # the rows whose outputs are computed: a0 .. T-1
        o_all = None if cache.capture is None else \
            torch.empty((n_out, self.n_heads, self.cfg.head_dim), dtype=x.dtype, device=x.device)
        p = None
        for a in range(a0, T, q_chunk):
            b = min(a + q_chunk, T)
            pc = positions[a:b]
            qc = self.queries_from(qr[a - a0:b - a0], pc)
            ic = idx[a - a0:b - a0] if idx is not None else None
            oc = self._attend(qc, keys[: n_past + b], n_past + a, pc, entries, ic, fast, shift).to(x.dtype)
            if o_all is not None:
                o_all[a - a0:b - a0] = oc
            pch = self.project(oc, pc)
            if p is None:
                p = torch.empty((n_out, pch.shape[1]), dtype=pch.dtype, device=x.device)
            p[a - a0:b - a0] = pch
        if p is None:                                    # no row asked for (T = 0 or out_rows = 0)
            p = x.new_empty((0, self.n_groups * self.cfg.o_lora_rank))
        if cache.capture is not None:
            keep = cache.capture.get("local_mask")
            if keep is None:
                cache.capture.update(latent=kv, o=o_all, topk=idx)
            else:   # the producer's Local contribution, computed now so per-head outputs are not kept
                local = self.project(o_all * keep.to(x.device, o_all.dtype)[None, :, None], positions[a0:])
                cache.capture.update(latent=kv, local_p=local, topk=idx)
        return self.output(p)


# ============================================================================ MoE

class Expert(nn.Module):
    """SwiGLU expert; routed experts clamp (gate above, up both sides) at swiglu_limit, the shared one
    does not (reference: Expert(dim, inter) with limit 0)."""

    def __init__(self, d: int, inter: int, dtype: torch.dtype, limit: float, quant_sim: bool):
        super().__init__()
        self.w1 = Linear(d, inter, dtype, fp8_act=True, quant_sim=quant_sim)
        self.w2 = Linear(inter, d, dtype, fp8_act=True, quant_sim=quant_sim)
        self.w3 = Linear(d, inter, dtype, fp8_act=True, quant_sim=quant_sim)
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.w2(self.activate_to(self.w1(x), self.w3(x), weights, x.dtype))

    def activate_to(self, gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor:
        """`activate` on the projections' outputs as they come, cast to `dtype` (W_2's input): on CUDA
        (runtime.kernels.enabled) in one pass (runtime/kernels/swiglu.py, the same float32 arithmetic), else the
        torch form."""
        if K.enabled(gate) and swiglu.supported(gate, up, weights):
            return swiglu.swiglu(gate, up, weights, self.limit, dtype)
        return self.activate(gate.float(), up.float(), weights).to(dtype)

    def activate(self, gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        return swiglu_activation(gate, up, weights, self.limit)


class Gate(nn.Module):
    """Router: scores = sqrt(softplus(x W^T)); the bias only steers selection; selected scores are
    normalized and scaled by route_scale. Hash layers select by a frozen tid2eid[token] table."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.hash = cfg, cfg.is_hash_layer(layer)
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.dim, dtype=torch.float32))
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.n_activated_experts, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        s = F.linear(x.float(), self.weight.float())
        if self.cfg.score_func == "softmax":
            return s.softmax(dim=-1)
        if self.cfg.score_func == "sigmoid":
            return s.sigmoid()
        return F.softplus(s).sqrt()

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, k: int | None = None):
        """-> (weights [T,k], expert ids [T,k]) sorted by decreasing selection score."""
        s = self.scores(x)
        if self.hash:
            idx = self.tid2eid[tokens].long()
        else:
            idx = (s + self.bias).topk(k or self.cfg.n_activated_experts, dim=-1).indices
        w = s.gather(1, idx)
        if self.cfg.score_func != "softmax":
            w = w / w.sum(dim=-1, keepdim=True)
        return w * self.cfg.route_scale, idx


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, par: Parallel, dtype: torch.dtype):
        super().__init__()
        E = cfg.n_routed_experts
        assert E % par.size == 0 and cfg.moe_inter_dim % par.size == 0, "experts / inter dim vs tp"
        self.par = par
        self.gate = Gate(cfg, layer)
        lo, hi = par.rank * E // par.size, (par.rank + 1) * E // par.size
        self.local = range(lo, hi)                                     # experts split across ranks
        self.experts = nn.ModuleDict({str(e): Expert(cfg.dim, cfg.moe_inter_dim, dtype, cfg.swiglu_limit,
                                                     cfg.quant_sim) for e in self.local})
        # the shared expert is split along its inner dim, so the all-reduce sums its partial outputs
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim // par.size, dtype, 0.0, cfg.quant_sim)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Sum over each row's routed slots of weight x expert(row), float32 [T, d]: the per-expert loop
        (`routed_loop`, the reference) or, where `grouped_ok` (CUDA) and the call has at most the policy's
        `moe_grouped_slots` (row, slot) pairs, one grouped GEMM per weight with no host read (`routed_grouped`)."""
        if idx.numel() <= self.policy.moe_grouped_slots and self.grouped_ok(x):
            return self.routed_grouped(x, weights, idx)
        return self.routed_loop(x, weights, idx)

    # the policy the model was given (Transformer.set_policy): its moe_grouped_slots says which calls take the
    # grouped form
    policy = DEFAULT_POLICY

    def grouped_ok(self, x: torch.Tensor) -> bool:
        """Where the grouped form can run: the kernels switch (runtime.kernels.enabled: CUDA, REDKNOT_KERNELS not
        0), torch._grouped_mm on a Hopper-or-later GPU, bf16 activations and weights, dims a multiple of 8 (16
        bytes). Its GEMMs take the loop's GPU time (bench/moe.py); what it saves is the loop's host read and
        per-expert launches (the policy's `moe_grouped_slots` says for which calls)."""
        w = self.experts[str(self.local[0])].w1.weight
        return (x.is_cuda and K.enabled(x) and hasattr(torch, "_grouped_mm")
                and x.dtype == w.dtype == torch.bfloat16
                and w.shape[0] % 8 == 0 and w.shape[1] % 8 == 0 and torch.cuda.get_device_capability(x.device)[0] >= 9)

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The local routed experts' w1, w3, w2 as three [E_local, out, in] stacks whose slices ARE the experts'
        weights: on first use (and again whenever a weight was replaced, e.g. by .to() or an assigning load) each
        weight is copied into its slot of a stack and the parameter re-pointed at it, so the stacks cost no memory
        beyond the experts' own and every in-place change to a weight is seen by both forms."""
        ex = [self.experts[str(e)] for e in self.local]
        params = [[getattr(x, n).weight for x in ex] for n in ("w1", "w3", "w2")]
        key = tuple(p.data_ptr() for group in params for p in group)
        if getattr(self, "_stacks_key", None) != key:
            with torch.no_grad(), torch.inference_mode(False):
                stacks = []
                for group in params:
                    st = torch.empty((len(group), *group[0].shape), dtype=group[0].dtype, device=group[0].device)
                    for i, p in enumerate(group):
                        st[i].copy_(p.data)
                        p.data = st[i]
                    stacks.append(st)
            self._stacks = tuple(stacks)
            self._stacks_key = tuple(p.data_ptr() for group in params for p in group)
        return self._stacks

    @staticmethod
    def _sorted_runs(ids: torch.Tensor, first: int, last: int):
        """(the stable order of `ids`, the ids in that order, edges [last - first + 1] with edges[v - first] = how
        many ids are < v, for v = first..last): where each id's run starts in the sorted slots, counted on the device
        (torch.bincount would read its input's min and max on the host first, two syncs)."""
        order = torch.argsort(ids, stable=True)
        s = ids[order]
        return order, s, torch.searchsorted(s, torch.arange(first, last + 1, device=ids.device, dtype=ids.dtype))

    def routed_grouped(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                       chunk: int = 32768) -> torch.Tensor:
        """`routed_loop`'s sum with one grouped GEMM per weight (torch._grouped_mm over `stacks`) and no host read:
        the (row, slot) ids sorted stably by local expert, slots of dropped (-1) or other ranks' experts sorted last
        and sent to a spare output row that is cut off. The sorted slots run in chunks of `chunk` (bounding the
        gathered activations: T x top-k rows would be 6 GB at 128K tokens), each expert's run clamped to the chunk,
        so a run may span two chunks. Each expert's rows and weights are the loop's; only the GEMM kernels (and so
        the float32 accumulation order inside them) differ."""
        w1, w3, w2 = self.stacks()
        lo, n_local = self.local[0], len(self.local)
        T, k = idx.shape
        flat = idx.flatten()
        if lo == 0 and n_local == self.gate.cfg.n_routed_experts:     # every expert here: only dropped slots go last
            key = torch.where(flat < 0, n_local, flat)
        else:
            flat = flat - lo
            key = torch.where((flat < 0) | (flat >= n_local), n_local, flat)
        order, sorted_key, ends = self._sorted_runs(key, 1, n_local)       # ends[e]: slots of experts <= e
        rows = torch.where(sorted_key < n_local, order // k, T)              # the spare row T takes the rest
        ws = weights.flatten()[order, None].float()
        ex = self.experts[str(lo)]                  # every routed expert has the same clamp and FP8 switch
        quant = ex.w1.simulate
        y = torch.zeros((T + 1, x.shape[1]), dtype=torch.float32, device=x.device)
        w1t, w3t, w2t = w1.transpose(1, 2), w3.transpose(1, 2), w2.transpose(1, 2)
        from .quant import fake_quant_fp8_act
        for a in range(0, T * k, chunk):
            b = min(a + chunk, T * k)
            # each expert's run clamped to the chunk (one chunk: the ends already lie in it)
            offs = ends.to(torch.int32) if a == 0 and b == T * k else (ends - a).clamp(0, b - a).to(torch.int32)
            r = rows[a:b]
            xs = x.index_select(0, r.clamp(max=T - 1))
            if quant:
                xs = fake_quant_fp8_act(xs)
            gate, up = (torch._grouped_mm(xs, w, offs=offs) for w in (w1t, w3t))
            h = ex.activate_to(gate, up, ws[a:b], x.dtype)
            if quant:
                h = fake_quant_fp8_act(h)
            y.index_add_(0, r, torch._grouped_mm(h, w2t, offs=offs).float())
        return y[:T]

    def routed_loop(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # an id of -1 marks a slot the caller dropped (adaptive fanout): it runs no expert. One stable sort of the
        # (row, slot) ids by expert and one host read of the counts replace a torch.where (a host sync) per expert;
        # each expert's (row, slot) list comes out in row-major order, exactly what torch.where(idx == e) gives, so
        # every expert sees the same rows and y sums them in the same order.
        # Row ids and weights are gathered once for all experts, each expert reading its contiguous run; the
        # activations are gathered per expert (all at once they would be T x top-k rows: 6 GB at 128K tokens).
        flat = idx.flatten()
        order, _, edges = self._sorted_runs(flat, -1, self.gate.cfg.n_routed_experts)
        counts = (edges[1:] - edges[:-1]).tolist()                       # slots of id -1, 0, .., E-1
        k, skip = idx.shape[1], counts[0]                                 # the -1 slots sort first
        order = order[skip:]
        rows, ws = order // k, weights.flatten()[order, None]
        a = 0
        for e in range(self.gate.cfg.n_routed_experts):
            n, a = counts[e + 1], a + counts[e + 1]
            if n == 0 or e not in self.local:
                continue
            r = rows[a - n:a]
            y.index_add_(0, r, self.experts[str(e)](x[r], ws[a - n:a]).float())
        return y

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x, tokens)
        y = self.routed(x, weights, idx) + self.shared_experts(x).float()
        return self.par.all_reduce(y).to(x.dtype)


# ============================================================================ mHC residual

def hc_mix_weights(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                   hc: int, iters: int, hc_eps: float, norm_eps: float):
    """x [T, hc, d] -> pre [T,hc], post [T,hc], comb [T,hc,hc] (doubly stochastic by Sinkhorn)."""
    flat = x.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(flat, fn.float())
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = mixes[:, 2 * hc:].view(-1, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = comb.softmax(dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, par: Parallel, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.attn = Attention(cfg, layer, par, dtype)
        self.ffn = MoE(cfg, layer, par, dtype)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        mix, hd = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.dim
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, hd, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def hc_pre(self, x: torch.Tensor, site: str):
        c = self.cfg
        fn, base, scale = (getattr(self, f"hc_{site}_{name}") for name in ("fn", "base", "scale"))
        if K.enabled(x) and mhc.supported(x):    # the same math fused (runtime/kernels/mhc.py)
            collapsed, pre, post, comb = mhc.hc_pre(x, fn, base, scale, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)
            return collapsed, post, comb
        pre, post, comb = hc_mix_weights(x, fn, base, scale, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)
        collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
        return collapsed, post, comb

    @staticmethod
    def hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                y_rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """New streams: post * block output + comb^T @ old streams (comb is doubly stochastic, not symmetric).
        With `y_rows`, row t's block output is y[y_rows[t]]; with `out` and `out_rows`, row t's new streams replace
        out[out_rows[t]] (in place) and out is returned. The kernel reads and writes those rows where they lie."""
        if (out is None) != (out_rows is None):
            raise ValueError("hc_post: out and out_rows come together")
        if K.enabled(x) and mhc.supported(x):
            return mhc.hc_post(y, x, post, comb, y_rows, out, out_rows)
        dt = x.dtype
        if y_rows is not None:
            y = y.index_select(0, y_rows)
        new = post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), x)
        return new if out is None else out.index_copy_(0, out_rows, new)

    def forward(self, x, tokens, positions, cache: LayerCache, q_chunk: int,
                out_rows: int | None = None) -> torch.Tensor:
        """x [T, hc, d] -> the new streams [T, hc, d]; with `out_rows`, those of the last out_rows rows only
        ([out_rows, hc, d]): every row still feeds the attention's cache (Attention.forward), the rest of the
        layer (queries, attention, W_a, W_b, the FFN, both mHC mixes past the attention input) runs on those
        rows alone."""
        with phase("blk.attn"):
            h, post, comb = self.hc_pre(x, "attn")
            y = self.attn(self.attn_norm(h), positions, cache, q_chunk, out_rows=out_rows)
            if out_rows is not None:
                a0 = max(x.shape[0] - int(out_rows), 0)
                x, post, comb, tokens = x[a0:], post[a0:], comb[a0:], tokens[a0:]
            x = self.hc_post(y, x, post, comb)
        return self.feed_forward(x, tokens)

    def feed_forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The layer's second half: the FFN (MoE) on the mixed streams, row by row."""
        with phase("blk.ffn"):
            h, post, comb = self.hc_pre(x, "ffn")
            return self.hc_post(self.ffn(self.ffn_norm(h), tokens), x, post, comb)

    def decode(self, x, tokens, positions, at: list[int], caches: list[LayerCache]) -> torch.Tensor:
        """`forward` of one new row for each of B requests (x [B, hc, d]), each over its own cache
        (Attention.decode); every other part of the layer is row-wise and runs once for the batch."""
        with phase("blk.attn"):
            h, post, comb = self.hc_pre(x, "attn")
            x = self.hc_post(self.attn.decode(self.attn_norm(h), positions, at, caches), x, post, comb)
        return self.feed_forward(x, tokens)


# ============================================================================ the model

def prefill_out_rows(cfg: ModelConfig, layer: int, cache: LayerCache | None = None) -> int | None:
    """Block.forward's `out_rows` for `layer` of a prefill whose next token is all that is read: 1 for the model's
    last layer, else None (every row). The next token reads the last row alone, and every row still feeds the
    layer's cache, so logits and cache are those of a full pass; not while a producer captures the layer's outputs
    (`cache.capture`), which needs every row's. The recompute arm (Transformer.forward), the
    reuse arm's last fence and the FLOP ledger all take the rule from here."""
    return 1 if layer == cfg.n_layers - 1 and (cache is None or cache.capture is None) else None


class Transformer(nn.Module):
    policy = DEFAULT_POLICY      # the rules the fast path follows (runtime/policy.py); `set_policy` hands one in

    def __init__(self, cfg: ModelConfig, par: Parallel | None = None, dtype: torch.dtype = torch.float32,
                 q_chunk: int = 4096, policy: RuntimePolicy | None = None):
        super().__init__()
        self.cfg, self.par = cfg, par or Parallel()
        self.dtype, self.q_chunk = dtype, q_chunk
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, i, self.par, dtype) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = Linear(cfg.dim, cfg.vocab_size, torch.float32)
        self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * cfg.dim, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        if policy is not None:
            self.set_policy(policy)

    def set_policy(self, policy: RuntimePolicy) -> RuntimePolicy:
        """The model and every module that follows a rule (the routed MoE) take `policy`; the reuse engine reads
        the model's. Returns the policy it replaces."""
        if not isinstance(policy, RuntimePolicy):
            raise TypeError(f"policy must be a RuntimePolicy, got {type(policy).__name__}")
        before = self.policy
        for m in self.modules():
            if isinstance(m, (Transformer, MoE)):
                m.policy = policy
        return before

    @contextlib.contextmanager
    def policy_as(self, policy: RuntimePolicy):
        """`policy` for the duration of the block (a benchmark's alternative arm, a test), then the one before."""
        before = self.set_policy(policy)
        try:
            yield self
        finally:
            self.set_policy(before)

    def new_cache(self) -> ModelCache:
        return ModelCache([LayerCache() for _ in range(self.cfg.n_layers)])

    def embed_streams(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return h.unsqueeze(1).repeat(1, self.cfg.hc_mult, 1)             # [T, hc, d]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Hyper head: collapse the streams with sigmoid weights, final norm, LM head (float32)."""
        c = self.cfg
        flat = x.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + c.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_head_fn) * self.hc_head_scale + self.hc_head_base) + c.hc_eps
        y = (pre.unsqueeze(-1) * x.float()).sum(dim=1)
        return self.head(self.norm(y))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: ModelCache | None = None, all_logits: bool = False):
        """Run `tokens` [T] after what `cache` already holds (prefill when it is empty). Returns logits for the
        last row ([vocab]) or every row ([T, vocab])."""
        cache = cache or self.new_cache()
        T = tokens.shape[0]
        positions = torch.arange(cache.pos, cache.pos + T, device=tokens.device)
        x = self.embed_streams(tokens)
        for i, (layer, lc) in enumerate(zip(self.layers, cache.layers)):
            x = layer(x, tokens, positions, lc, self.q_chunk,
                      out_rows=None if all_logits else prefill_out_rows(self.cfg, i, lc))
        cache.pos += T
        return self.logits(x) if all_logits else self.logits(x[-1:])[0]

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, caches: list[ModelCache]) -> torch.Tensor:
        """One decode step of B requests at once: token b [B] after what caches[b] holds (each request at its own
        position); returns their next logits [B, vocab]. Equal, request by request, to `forward` of that one
        token over that cache (up to the rounding of batched products); the projections, the MoE and the head
        run once for the batch."""
        if tokens.dim() != 1 or tokens.shape[0] != len(caches) or not caches:
            raise ValueError(f"decode: {tuple(tokens.shape)} tokens for {len(caches)} caches")
        at = [c.pos for c in caches]
        positions = torch.tensor(at, device=tokens.device)
        x = self.embed_streams(tokens)
        for i, layer in enumerate(self.layers):
            x = layer.decode(x, tokens, positions, at, [c.layers[i] for c in caches])
        for c in caches:
            c.pos += 1
        return self.logits(x)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, cache: ModelCache, chunk: int | None = None) -> torch.Tensor:
        """Extend the cache by `tokens` in chunks (`chunk`, else the policy's `prefill_chunk`, else one forward);
        chunked prefill equals one-shot prefill."""
        chunk = chunk or self.policy.prefill_chunk or tokens.shape[0]
        out = None
        for a in range(0, tokens.shape[0], chunk):
            out = self.forward(tokens[a:a + chunk], cache)
        return out

    @torch.inference_mode()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, chunk: int | None = None,
                 eos: int | None = None) -> tuple[list[int], ModelCache]:
        """Greedy decoding; stops at `eos` (the config's when None) or after max_new_tokens."""
        eos = self.cfg.eos_token_id if eos is None else eos
        cache = self.new_cache()
        logits = self.prefill(tokens, cache, chunk)
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(logits.argmax())
            out.append(nxt)
            if nxt == eos:
                break
            logits = self.forward(torch.tensor([nxt], device=tokens.device), cache)
        return out, cache
