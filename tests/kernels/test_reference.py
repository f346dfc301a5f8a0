"""CPU checks that runtime/kernels/reference.py (the kernels' oracle) computes what the model computes:
the window part equals `window_attention` (and the consumer's `_window_part`), the sparse reference with
mode 'causal'/'picks' equals the model's per-chunk parts merged by LSE, and the indexer reference equals
`Indexer.scores` + `Indexer.forward`'s top-k."""
import math

import torch

from runtime.kernels.reference import (_merge_no_sink, indexer_scores_reference, indexer_topk_reference,
                                       sparse_mqa_reference, window_part)
from runtime.model.config import tiny
from runtime.model.deepseek_v4 import (CompressorState, Indexer, Rotary, entry_attention, gathered_attention,
                                       merge_with_sink, window_attention, yarn_inv_freq)


def test_window_part_equals_model_window_attention():
    g = torch.Generator().manual_seed(0)
    T, H, D, W, n_past = 50, 4, 32, 16, 7
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    keys = torch.randn(n_past + T, D, generator=g, dtype=torch.float64)
    o, lse = window_attention(q, keys, n_past, W, D ** -0.5)
    o2, lse2 = window_part(q, keys, n_past + torch.arange(T), W, D ** -0.5)
    assert torch.allclose(o, o2) and torch.equal(lse, lse2)


def test_sparse_reference_equals_model_parts_with_sink():
    g = torch.Generator().manual_seed(1)
    T, H, D, W, N, k = 40, 4, 32, 8, 9, 5
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    keys = torch.randn(T, D, generator=g, dtype=torch.float64)
    ent = torch.randn(N, D, generator=g, dtype=torch.float64)
    cpos = torch.arange(T)
    picks = torch.randint(-1, N, (T, k), generator=g)
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    scale = D ** -0.5
    vis = torch.arange(N)[None, :] < ((cpos + 1) // 4)[:, None]
    for mode, part in (("causal", entry_attention(q, ent, vis, scale)), ("picks", gathered_attention(q, ent, picks, scale))):
        want = merge_with_sink([window_attention(q, keys, 0, W, scale), part], sink)
        o, lse = sparse_mqa_reference(q, keys, cpos, W, ent, mode, 4, picks, chunk=16)
        got = merge_with_sink([(o, lse)], sink)                     # the sink joins once, after the merge
        assert torch.allclose(got.double(), want.double(), atol=1e-6), mode


def test_merge_without_sink_handles_empty_rows():
    o = torch.randn(3, 2, 4)
    lse = torch.tensor([[0.5, float("-inf")], [1.0, 2.0], [float("-inf"), float("-inf")]])
    out, total = _merge_no_sink([(o, lse), (2 * o, lse - math.log(2.0))])
    assert not torch.isnan(out).any()
    assert torch.isinf(total[2]).all() and (out[2] == 0).all() and (out[0, 1] == 0).all()
    assert torch.allclose(out[1], (o[1] + o[1] * 2 * 0.5) / 1.5, atol=1e-6)


def test_indexer_reference_equals_model_indexer():
    cfg = tiny()
    torch.manual_seed(2)
    inv = yarn_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.rope_factor, cfg.original_seq_len,
                        cfg.beta_fast, cfg.beta_slow)
    idx = Indexer(cfg, Rotary(inv), torch.float32)
    for p in idx.parameters():
        p.data.normal_(0, 0.3)
    T = 64
    x, qr = torch.randn(T, cfg.dim), torch.randn(T, cfg.q_lora_rank)
    pos = torch.arange(T)
    keys = torch.randn(T // 4, cfg.index_head_dim)
    want = idx.scores(x, qr, pos, keys)
    q = Rotary.apply(idx.wq_b(qr).view(T, idx.n_heads, idx.head_dim), *idx.rotary.cos_sin(pos))
    w = idx.weights_proj(x).float() * idx.n_heads ** -0.5
    got = indexer_scores_reference(q, keys, w, pos)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], atol=1e-5)
    state = CompressorState()
    native = idx(x, qr, pos, state, q_chunk=16)
    ref_idx, _ = indexer_topk_reference(q, state.entries, w, pos, cfg.index_topk)
    assert torch.equal(native, ref_idx)


def test_rope_in_place_equals_rotary_apply():
    """rope_ (the consumer's RoPE on the 64 channels only, in place) computes what Rotary.apply computes."""
    from runtime.kernels.rope import rope_reference_
    g = torch.Generator().manual_seed(5)
    T, H, D, rd = 37, 6, 64, 16
    rot = Rotary(yarn_inv_freq(rd, 160000.0, 16.0, 64, 32.0, 1.0))
    cos, sin = rot.cos_sin(torch.randint(0, 5000, (T,), generator=g))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(T, H, D, generator=g).to(dtype)
        for inverse in (False, True):
            want = Rotary.apply(x, cos, sin, inverse=inverse)
            got = rope_reference_(x.clone(), cos, sin, inverse=inverse)
            assert torch.equal(got, want)
            dst = torch.zeros_like(x)          # from src: only the rope channels are written
            rope_reference_(dst, cos, sin, inverse=inverse, src=x)
            assert torch.equal(dst[..., -rd:], want[..., -rd:]) and (dst[..., :-rd] == 0).all()


def test_merge_stacked_reference_equals_merge_with_sink():
    """Stacked parts with uncovered rows (LSE -inf, o unwritten garbage) merge like merge_with_sink over the parts
    with those rows empty."""
    from runtime.kernels.merge import merge_stacked_reference
    g = torch.Generator().manual_seed(6)
    P, T, H, D = 4, 30, 5, 16
    o = torch.randn(P, T, H, D, generator=g, dtype=torch.float64)
    lse = torch.randn(P, T, H, generator=g, dtype=torch.float64) * 3
    ranges = [(0, T), (4, 20), (10, T), (0, 0)]
    for p, (lo, hi) in enumerate(ranges):
        lse[p, :lo], lse[p, hi:] = float("-inf"), float("-inf")
        o[p, :lo], o[p, hi:] = float("nan"), float("nan")
    lse[1, 6] = float("-inf")                 # an empty row inside a covered range
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    want = merge_with_sink([(torch.nan_to_num(o[p]), lse[p]) for p in range(P)], sink)
    for rg in (ranges, None):
        got = merge_stacked_reference(o, lse, sink, torch.float64, rg)
        assert not torch.isnan(got).any() and torch.allclose(got, want.double())
