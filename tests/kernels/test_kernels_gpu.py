"""GPU kernels against their torch references (runtime/kernels/reference.py), on fresh random inputs.

Skipped where Triton or CUDA is missing (CPU CI). Tolerance per the device tool's METHOD.md for bf16 operands:
||out - ref|| / ||ref|| < 1e-2 against a float32 reference on the upcast inputs; NaN never passes; outputs are
poisoned (NaN-filled allocator blocks) before each run so an unwritten element fails. LSEs must agree on which
rows are empty (-inf) and be within 1e-2 elsewhere.
"""

import pytest
import torch

from runtime.kernels import available
from runtime.policy import RuntimePolicy

pytestmark = pytest.mark.skipif(not available(), reason="needs Triton and a CUDA device")

if available():
    from runtime.kernels import indexer_scores, indexer_topk, merge_lse, sparse_mqa_attention
    from runtime.kernels.reference import indexer_scores_reference, sparse_mqa_reference
    from runtime.model.deepseek_v4 import merge_with_sink

TOL = 1e-2
DEV = "cuda"
DT = torch.bfloat16      # DEV/DT are module globals so a CPU debug run (TRITON_INTERPRET=1, fp16) can reuse the cases


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in the kernel output"
    den = ref.double().norm()
    return float((out.double() - ref.double()).norm() / (den if den > 0 else 1.0))


def poison(nbytes: int = 1 << 30) -> None:
    """Leave NaN in the caching allocator's free blocks, so torch.empty inside a kernel wrapper returns NaNs."""
    if DEV != "cuda":
        return
    torch.cuda.synchronize()
    x = torch.full((nbytes // 4,), float("nan"), device=DEV)
    del x


def check_lse(lse, ref_lse):
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "empty rows differ"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        assert float((lse[fin] - ref_lse[fin]).abs().max()) < TOL


def causal_picks(cpos: torch.Tensor, n_entries: int, k: int, ratio: int = 4, gen=None) -> torch.Tensor:
    """k distinct picks per row among the entries visible to it ((cpos+1)//ratio), -1 padded, shuffled."""
    T = cpos.shape[0]
    ready = ((cpos + 1) // ratio).clamp(0, n_entries)
    r = torch.rand(T, n_entries, device=cpos.device, generator=gen)
    r = r.masked_fill(torch.arange(n_entries, device=cpos.device)[None, :] >= ready[:, None], 2.0)
    kk = min(k, n_entries)
    top = torch.topk(r, kk, dim=-1, largest=False)
    idx = torch.where(top.values < 2.0, top.indices, torch.full_like(top.indices, -1))
    if kk < k:
        idx = torch.cat([idx, torch.full((T, k - kk), -1, device=cpos.device, dtype=idx.dtype)], dim=1)
    return idx[:, torch.randperm(k, device=cpos.device, generator=gen)].to(torch.int32)


def run_case(T, H, D, W, n, mode, N=0, ratio=4, k=0, cpos=None, seed=0, picks=None, config=None, chunk=1024,
             pos_shift=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(T, H, D, device=DEV, generator=g).to(DT)
    keys = torch.randn(n, D, device=DEV, generator=g).to(DT)
    ent = torch.randn(N, D, device=DEV, generator=g).to(DT) if N else None
    if cpos is None:
        cpos = torch.arange(n - T, n, device=DEV) if n >= T else torch.arange(T, device=DEV)
    if mode == "picks" and picks is None:
        picks = causal_picks(cpos, N, k, ratio, g)
    poison()
    o, lse = sparse_mqa_attention(q, keys, cpos, W, ent, mode, ratio, picks, config=config, pos_shift=pos_shift)
    ro, rl = sparse_mqa_reference(q.float(), keys.float(), cpos, W, None if ent is None else ent.float(), mode, ratio,
                                  picks, chunk=chunk, pos_shift=pos_shift)
    err = rel_err(o, ro)
    assert err < TOL, f"rel err {err:.2e}"
    check_lse(lse, rl)
    return err


# ---------------------------------------------------------------- sparse MQA attention

@pytest.mark.parametrize("mode", ["none", "causal", "picks"])
def test_sparse_small_odd_shapes(mode):
    # H not a multiple of the head block, cpos anywhere (before 0, past the keys), n smaller than the window reach
    T, H, D, W, n, N = 333, 20, 128, 32, 300, 80
    cpos = torch.randint(-40, n + 80, (T,), device=DEV)
    run_case(T, H, D, W, n, mode, N=N, ratio=4, k=48, cpos=cpos, seed=1)


@pytest.mark.parametrize("mode,N,ratio", [("none", 0, 1), ("causal", 32, 128), ("causal", 1024, 4), ("picks", 1024, 4)])
def test_sparse_real_dims(mode, N, ratio):
    # DeepSeek-V4-Flash per rank at TP1: 64 heads, D = 512, W = 128, top-k 512; thousands of query rows
    run_case(4096, 64, 512, 128, 4096, mode, N=N, ratio=ratio, k=512, seed=2)


@pytest.mark.parametrize("H", [8, 24])
def test_sparse_few_heads(H):
    # a Global-head subset: fewer heads than one 64-head block (BLOCK_H 16 / 32, masked rows)
    run_case(1024, H, 512, 128, 4096, "picks", N=1024, ratio=4, k=512, seed=10 + H)


def _gapped_positions(T: int, n: int, seed: int) -> torch.Tensor:
    """T increasing positions below n with gaps (the non-active rows of a reuse request: active rows removed), a
    few long ones."""
    g = torch.Generator().manual_seed(seed)
    step = torch.where(torch.rand(T, generator=g) < 0.9, 1, torch.randint(2, 400, (T,), generator=g))
    pos = torch.cumsum(step, 0)
    return (pos - pos[-1] + n - 1).clamp(min=-3).to(DEV)


@pytest.mark.parametrize("mode,N,ratio", [("none", 0, 1), ("causal", 1024, 128), ("causal", 2048, 4)])
@pytest.mark.parametrize("H", [8, 3])
def test_sparse_packed_rows_few_heads(mode, N, ratio, H, monkeypatch):
    """Few heads in modes none/causal take several query rows per program (`_sparse_mqa_rows_kernel`, ROWS x heads
    = 64 rows of the MMA tile: 8 rows of the Global heads' 8, 16 rows of 3 heads padded to 4): equal to the
    reference at real dims on gapped positions, with positions unsorted and rows past T in the last program."""
    from runtime.kernels.sparse_attention import packed_rows
    assert packed_rows(H, mode) == (8 if H == 8 else 16) and packed_rows(H, "picks") == 1
    n = 131072 if mode == "causal" and ratio == 128 else 8192
    run_case(4099, H, 512, 128, n, mode, N=N, ratio=ratio, seed=20 + H, cpos=_gapped_positions(4099, n, H))
    shuffled = _gapped_positions(777, n, H + 1)[torch.randperm(777, generator=torch.Generator().manual_seed(1))]
    run_case(777, H, 512, 128, n, mode, N=N, ratio=ratio, seed=30 + H, cpos=shuffled, pos_shift=5)


def test_sparse_packed_rows_equal_one_row_per_program(monkeypatch):
    """Packed rows (the default for 8 heads) and one row per program (config ROWS=1): within bf16 rounding of each
    other on 8 heads."""
    g = torch.Generator(device=DEV).manual_seed(9)
    T, H, D, n, N = 2000, 8, 512, 8192, 64
    q = torch.randn(T, H, D, device=DEV, generator=g).to(DT)
    keys = torch.randn(n, D, device=DEV, generator=g).to(DT)
    ent = torch.randn(N, D, device=DEV, generator=g).to(DT)
    cpos = _gapped_positions(T, n, 3)
    a = sparse_mqa_attention(q, keys, cpos, 128, ent, "causal", 128)
    b = sparse_mqa_attention(q, keys, cpos, 128, ent, "causal", 128, config={"ROWS": 1})
    assert rel_err(a[0], b[0]) < 1e-3
    check_lse(a[1], b[1])


def test_sparse_real_dims_long_prefix():
    # rows deep in a long segment: every window full, 512 picks of 4K visible entries
    T, n = 2048, 16384
    run_case(T, 64, 512, 128, n, "picks", N=n // 4, ratio=4, k=512, seed=3, cpos=torch.arange(n - T, n, device=DEV))


@pytest.mark.parametrize("shift", [1, 127, 4097])
def test_sparse_causal_keys_after_position_zero(shift):
    """A cache holding only the window's last rows: key row r is position r + shift, so entry visibility reads
    (cpos + shift + 1) // ratio (the fence layers of the reuse arm and decoding; wrong before 2026-11-30)."""
    T, W = 200, 128
    run_case(T, 64, 512, W, W - 1 + T, "causal", N=(W - 1 + T + shift) // 128 + 2, ratio=128, seed=8,
             cpos=torch.arange(W - 1, W - 1 + T, device=DEV), pos_shift=shift)


def test_sparse_edge_cases():
    T, H, D, W = 256, 64, 512, 128
    # cpos < W everywhere: the window is clipped at row 0
    run_case(T, H, D, W, 512, "none", cpos=torch.arange(T, device=DEV), seed=4)
    # no visible entries: cpos + 1 < ratio for every row
    run_case(T, H, D, W, 512, "causal", N=16, ratio=1024, cpos=torch.arange(T, device=DEV), seed=5)
    # all picks -1
    picks = torch.full((T, 512), -1, dtype=torch.int32, device=DEV)
    run_case(T, H, D, W, 512, "picks", N=64, picks=picks, cpos=torch.arange(T, device=DEV), seed=6)
    # queries before the segment or past its window reach: empty rows (o = 0, lse = -inf)
    cpos = torch.cat([torch.full((8,), -5, device=DEV), torch.full((8,), 1000, device=DEV)])
    g = torch.Generator(device=DEV).manual_seed(7)
    q = torch.randn(16, H, D, device=DEV, generator=g).to(DT)
    keys = torch.randn(100, D, device=DEV, generator=g).to(DT)
    poison()
    o, lse = sparse_mqa_attention(q, keys, cpos, W)
    assert torch.isinf(lse).all() and (lse < 0).all() and (o == 0).all()


def test_sparse_block_configs_agree():
    # the variants the benchmark may pick compute the same function (DV=256 needs BLOCK_N=32: at 64 the
    # stages take 262 KB of shared memory, over the 227 KB limit)
    for cfg in (dict(BLOCK_N=32), dict(DV=256, BLOCK_N=32), dict(BLOCK_N=16, num_stages=3), dict(BLOCK_H=32, BLOCK_N=64),
                dict(BLOCK_H=16, BLOCK_N=64, num_warps=4)):
        run_case(512, 64, 512, 128, 2048, "picks", N=512, k=512, seed=8, config=cfg)


# ---------------------------------------------------------------- merge

@pytest.mark.parametrize("P,T,H,D", [(1, 100, 8, 64), (3, 1000, 64, 512), (5, 777, 20, 128)])
def test_merge_lse_equals_merge_with_sink(P, T, H, D):
    g = torch.Generator(device=DEV).manual_seed(P)
    parts = []
    for i in range(P):
        o = torch.randn(T, H, D, device=DEV, generator=g)
        lse = torch.randn(T, H, device=DEV, generator=g) * 3
        lse[torch.rand(T, H, device=DEV, generator=g) < 0.2] = float("-inf")   # empty parts in some rows
        parts.append((o, lse))
    parts[0][1][:5] = float("-inf")
    sink = torch.randn(H, device=DEV, generator=g)
    poison()
    out = merge_lse(parts, sink)
    assert rel_err(out, merge_with_sink(parts, sink)) < 1e-5
    # without a sink: the merged LSE, -inf where every part is empty
    for p in parts:
        p[1][:5] = float("-inf")
    out, lse = merge_lse(parts, None, return_lse=True)
    want = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
    check_lse(lse, want)
    assert (out[:5] == 0).all() and not torch.isnan(out).any()


def _picks_case(T, H, D, n, N, seed):
    """A segment's last T rows as queries, n keys, N entries and 512 causal picks per row."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(T, H, D, device=DEV, generator=g).to(DT)
    keys = torch.randn(n, D, device=DEV, generator=g).to(DT)
    ent = torch.randn(N, D, device=DEV, generator=g).to(DT)
    cpos = torch.arange(n - T, n, device=DEV)
    return g, q, keys, ent, cpos, causal_picks(cpos, N, 512, 4, g)


def test_sparse_parts_merge_equals_model_merge():
    # window part and picks part as separate kernel calls, merged with the sink by merge_lse
    T, H, D, n, N = 1024, 64, 512, 4096, 1024
    g, q, keys, ent, cpos, picks = _picks_case(T, H, D, n, N, seed=9)
    sink = torch.randn(H, device=DEV, generator=g)
    a = sparse_mqa_attention(q, keys, cpos, 128)
    b = sparse_mqa_attention(q, keys[:0], cpos, 128, ent, "picks", 4, picks)
    got = merge_lse([a, b], sink)
    ro, rl = sparse_mqa_reference(q.float(), keys.float(), cpos, 128, ent.float(), "picks", 4, picks)
    assert rel_err(got, merge_with_sink([(ro, rl)], sink)) < TOL


# ---------------------------------------------------------------- indexer

def _indexer_inputs(T, N, IH=64, ID=128, seed=0, offset=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(T, IH, ID, device=DEV, generator=g).to(DT)
    keys = torch.randn(N, ID, device=DEV, generator=g).to(DT)
    w = torch.randn(T, IH, device=DEV, generator=g) * IH ** -0.5
    start = 4 * N - T if offset is None else offset
    cpos = torch.arange(start, start + T, device=DEV)
    return q, keys, w, cpos


@pytest.mark.parametrize("T,N,IH,ID", [(300, 100, 16, 32), (4096, 1024, 64, 128), (2048, 8192, 64, 128)])
def test_indexer_scores(T, N, IH, ID):
    q, keys, w, cpos = _indexer_inputs(T, N, IH, ID, seed=T)
    poison()
    s = indexer_scores(q, keys, w, cpos)
    ref = torch.cat([indexer_scores_reference(q[a:a + 512].float(), keys.float(), w[a:a + 512], cpos[a:a + 512])
                     for a in range(0, T, 512)])
    assert not torch.isnan(s).any()
    assert torch.equal(torch.isinf(s), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert rel_err(s[fin], ref[fin]) < TOL


@pytest.mark.parametrize("P", [1, 8, 33])
def test_indexer_scores_parts_equal_each_segments_frame(P):
    """Flash's indexer (64 heads x 128, 64 rope channels, YaRN) over P uneven segments in one launch, the query
    roped at t and the keys turned by +Delta_j in the kernel, against the float32 reference in each segment's
    frame (query roped at t - Delta_j, entries complete before t - Delta_j), rows up to 128K."""
    from runtime.kernels import indexer_scores_parts
    from runtime.kernels.rope import rope_reference_
    from runtime.model.deepseek_v4 import Rotary, yarn_inv_freq
    g = torch.Generator(device="cpu").manual_seed(P)
    raw = torch.randint(256, 8192, (P,), generator=g).float()
    lens = (raw * 131072 / raw.sum()).long().tolist()                   # uneven, 128K in all
    deltas = [sum(lens[:j]) for j in range(P)]
    rot = Rotary(yarn_inv_freq(64, 160000.0, 16.0, 65536, 32.0, 1.0))
    keys = [torch.randn(n // 4, 128, generator=g).to(DEV, DT) for n in lens]
    T = 1500
    rows = torch.sort(torch.randint(0, sum(lens) + 64, (T,), generator=g)).values.to(DEV)
    q_raw = torch.randn(T, 64, 128, generator=g).to(DEV, DT)
    w = (torch.randn(T, 64, generator=g) * 64 ** -0.5).to(DEV)
    q = rope_reference_(q_raw.clone(), *rot.cos_sin(rows))
    cs = torch.stack(rot.cos_sin(torch.tensor(deltas, device=DEV)), dim=1)
    poison()
    got = torch.empty(T, sum(k.shape[0] for k in keys), device=DEV)
    indexer_scores_parts(q, keys, deltas, cs, w, rows, got)
    want = torch.cat([indexer_scores_reference(rope_reference_(q_raw.float(), *rot.cos_sin(rows - d)), k.float(), w,
                                               rows - d) for k, d in zip(keys, deltas)], dim=1)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not torch.isnan(got).any()
    fin = torch.isfinite(want)
    assert rel_err(got[fin], want[fin]) < TOL


@pytest.mark.parametrize("T,N,k,offset", [(4096, 1024, 512, 0), (8192, 4096, 512, None), (1000, 300, 512, 0)])
def test_indexer_topk(T, N, k, offset):
    q, keys, w, cpos = _indexer_inputs(T, N, seed=k + T, offset=offset)
    poison()
    idx, vals = indexer_topk(q, keys, w, cpos, k, chunk_elems=1 << 22)      # several score chunks
    kk = min(k, N)
    assert idx.shape == (T, kk) and idx.dtype == torch.int64
    ready = ((cpos + 1) // 4).clamp(0, N)
    assert torch.equal((idx >= 0).sum(1), ready.clamp(max=kk)), "number of picks per row"
    for a in range(0, T, 512):
        ref = indexer_scores_reference(q[a:a + 512].float(), keys.float(), w[a:a + 512], cpos[a:a + 512])
        want = ref.topk(kk, dim=-1).values                                # ties aside: compare the sets' scores
        i = idx[a:a + 512]
        got = torch.where(i >= 0, ref.gather(1, i.clamp(min=0)), torch.full_like(want, float("-inf")))
        got = got.sort(dim=-1, descending=True).values
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got))
        scale = want[fin].abs().max().clamp(min=1e-6)
        assert float((got[fin] - want[fin]).abs().max() / scale) < 1e-3
        # picks are distinct entries
        srt = i.sort(dim=-1).values
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        assert not dup.any()


# ---------------------------------------------------------------- consumer: RoPE slice, stacked merge, out= buffers

@pytest.mark.parametrize("H,dtype", [(64, torch.bfloat16), (8, torch.float32), (20, torch.bfloat16)])
def test_rope_kernel_equals_reference(H, dtype):
    from runtime.kernels.rope import rope_, rope_reference_
    from runtime.model.deepseek_v4 import Rotary, yarn_inv_freq
    g = torch.Generator(device=DEV).manual_seed(H)
    T, D = 1000, 512
    rot = Rotary(yarn_inv_freq(64, 160000.0, 16.0, 65536, 32.0, 1.0))
    cos, sin = rot.cos_sin(torch.randint(0, 131072, (T,), device=DEV, generator=g))
    x = torch.randn(T, H, D, device=DEV, generator=g).to(dtype)
    for inverse in (False, True):
        want = rope_reference_(x.clone(), cos, sin, inverse)
        got = rope_(x.clone(), cos, sin, inverse)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5       # bf16: a rounding flip where the FMA differs
        assert rel_err(got, want) < tol and torch.equal(got[..., :-64], x[..., :-64])
        dst = torch.zeros_like(x)                    # from src, into a strided row slice of a bigger buffer
        buf = torch.zeros(2, T + 10, H, D, device=DEV, dtype=dtype)
        rope_(buf[1, 5:5 + T], cos, sin, inverse, src=x)
        rope_reference_(dst, cos, sin, inverse, src=x)
        assert rel_err(buf[1, 5:5 + T], dst) < tol and (buf[0] == 0).all() and (buf[1, :5] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_apply_kernel_path_equals_torch_path(dtype, monkeypatch):
    """Rotary.apply on CUDA (the other channels copied, the rope channels by rope_) against its torch path
    (REDKNOT_KERNELS=0): a [T, D] latent, [T, H, D] heads and a strided row slice, both directions."""
    from runtime.model.deepseek_v4 import Rotary, yarn_inv_freq
    g = torch.Generator(device=DEV).manual_seed(7)
    rot = Rotary(yarn_inv_freq(64, 160000.0, 16.0, 65536, 32.0, 1.0))
    cos, sin = rot.cos_sin(torch.randint(0, 131072, (300,), device=DEV, generator=g))
    big = torch.randn(600, 8, 512, device=DEV, generator=g).to(dtype)
    for x in (big[:300, 0], big[:300], big[::2]):
        for inverse in (False, True):
            monkeypatch.setenv("REDKNOT_KERNELS", "0")
            want = Rotary.apply(x, cos, sin, inverse)
            monkeypatch.setenv("REDKNOT_KERNELS", "1")
            got = Rotary.apply(x, cos, sin, inverse)
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5       # bf16: a rounding flip where the FMA differs
            assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
            assert rel_err(got, want) < tol and torch.equal(got[..., :-64], x[..., :-64])


@pytest.mark.parametrize("P,T,H,D,dtype", [(9, 1000, 64, 512, torch.bfloat16), (3, 777, 8, 512, torch.float32),
                                           (1, 50, 20, 128, torch.float32), (0, 10, 8, 64, torch.bfloat16)])
def test_merge_stacked_equals_reference(P, T, H, D, dtype):
    from runtime.kernels.merge import merge_stacked, merge_stacked_reference
    g = torch.Generator(device=DEV).manual_seed(P + T)
    o = torch.full((P, T, H, D), float("nan"), device=DEV)          # unwritten rows must never be read
    lse = torch.full((P, T, H), float("-inf"), device=DEV)
    ranges = []
    for p in range(P):
        lo = int(torch.randint(0, T, (1,), generator=g, device=DEV))
        hi = T if p % 2 else int(torch.randint(lo, T + 1, (1,), generator=g, device=DEV))
        o[p, lo:hi] = torch.randn(hi - lo, H, D, device=DEV, generator=g)
        lse[p, lo:hi] = torch.randn(hi - lo, H, device=DEV, generator=g) * 3
        ranges.append((lo, hi))
    sink = torch.randn(H, device=DEV, generator=g)
    got = merge_stacked(o, lse, sink, dtype)
    want = merge_stacked_reference(o, lse, sink, torch.float32, ranges)
    assert got.dtype == dtype and rel_err(got, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_sparse_out_buffers_equal_fresh_outputs():
    # the consumer writes each segment's part into a slice of one stacked buffer
    T, H, D, n, N = 512, 64, 512, 2048, 512
    _, q, keys, ent, cpos, picks = _picks_case(T, H, D, n, N, seed=11)
    o_buf = torch.full((2, T + 7, H, D), float("nan"), device=DEV)
    l_buf = torch.full((2, T + 7, H), float("nan"), device=DEV)
    sparse_mqa_attention(q, keys, cpos, 128, ent, "picks", 4, picks, out=(o_buf[1, 7:], l_buf[1, 7:]))
    o, lse = sparse_mqa_attention(q, keys, cpos, 128, ent, "picks", 4, picks)
    assert torch.equal(o_buf[1, 7:], o) and torch.equal(l_buf[1, 7:], lse)
    assert torch.isnan(o_buf[0]).all() and torch.isnan(o_buf[1, :7]).all()


@pytest.mark.parametrize("T,D", [(1, 4096), (37, 64), (1000, 4096), (4099, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mhc_kernels_equal_model_hc(T, D, dtype):
    """runtime/kernels/mhc.py against the model's torch path (`hc_mix_weights`, `Block.hc_pre`'s collapse,
    `Block.hc_post`) on the same inputs, computed in float64: pre/post/comb to 1e-5 (float32 math in both), the
    collapsed and new streams to 1e-6 in float32 and the bf16 tolerance otherwise; Sinkhorn's last step leaves
    every column of comb summing to 1."""
    from runtime.kernels import mhc
    from runtime.model.deepseek_v4 import Block, hc_mix_weights
    g = torch.Generator(device=DEV).manual_seed(T + D)
    hc, mix = 4, 24
    x = torch.randn(T, hc, D, device=DEV, generator=g).to(dtype)
    fn = torch.randn(mix, hc * D, device=DEV, generator=g) * (hc * D) ** -0.5
    base = torch.randn(mix, device=DEV, generator=g) * 0.3
    scale = torch.tensor([0.8, 1.1, 2.0], device=DEV)
    y = torch.randn(T, D, device=DEV, generator=g).to(dtype)
    poison()
    col, pre, post, comb = mhc.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
    new = mhc.hc_post(y, x, post, comb)
    rpre, rpost, rcomb = hc_mix_weights(x.double(), fn.double(), base.double(), scale.double(), hc, 20, 1e-6, 1e-6)
    assert rel_err(pre, rpre) < 1e-5 and rel_err(post, rpost) < 1e-5 and rel_err(comb, rcomb) < 1e-5
    assert float((comb.sum(-2) - 1).abs().max()) < 1e-4
    tol = 1e-6 if dtype == torch.float32 else TOL
    assert rel_err(col, (rpre.unsqueeze(-1) * x.double()).sum(1)) < tol
    assert rel_err(new, Block.hc_post(y.double(), x.double(), post.double(), comb.double())) < tol
    # row maps (the consumer's split layout and in-place FFN rows): bit for bit the plain kernel on gathered y, its
    # result written into the given rows of an existing tensor, the other rows untouched
    perm = torch.randperm(T, device=DEV, generator=g)
    dst = torch.randn(T + 5, hc, D, device=DEV, generator=g).to(dtype)
    rows = torch.randperm(T + 5, device=DEV, generator=g)[:T]
    keep = dst.clone()
    got = mhc.hc_post(y, x, post, comb, perm, dst, rows)
    assert got is dst and torch.equal(got[rows], mhc.hc_post(y[perm], x, post, comb))
    others = torch.ones(T + 5, dtype=torch.bool, device=DEV)
    others[rows] = False
    assert torch.equal(got[others], keep[others])


SHAPES = [("window", 64), ("hca", 64), ("hca", 8), ("csa-own", 64), ("csa-own", 8)]


@pytest.mark.parametrize("kind,H,path", [(k, h, p) for k, h in SHAPES for p in ("fused", "stacked")]
                         + [("csa-union", 8, "stacked"), ("csa-union", 64, "stacked"), ("hca", 64, "key"),
                            ("hca", 8, "key")])
def test_fused_multi_segment_equals_reference(kind, H, path, monkeypatch):
    """runtime/kernels/multiseg.py (`path` "fused"), or the stacked parts in one launch per kind of part
    (`sparse_mqa_parts`, "stacked"), through runtime/reuse/segments.py `segment_attention` at real dims (D = 512,
    64 rope channels, window 128; 64 heads, or the 8 Global heads), five segments at their offsets (a prefix, three
    relocated documents, new rows), bf16, against the reference path (per-segment torch attention, query rotation,
    de-rotation, stacked merge with the sink) on the float32 upcast inputs. csa-union: a caller's picks over every
    segment (the stacked path; each picks part reads its segment's run of the row's sorted ids). "key": the fused
    HCA call in the key frame (one row per program with 64 heads, 8 rows x 8 heads with the Global heads)."""
    import types
    import runtime.reuse.segments as C
    from runtime.model.config import CSA, HCA, WINDOW
    from runtime.model.deepseek_v4 import Rotary
    g = torch.Generator(device=DEV).manual_seed(H + len(kind))
    D, W, ratio = 512, 128, {"window": 1, "hca": 128, "csa-own": 4, "csa-union": 4}[kind]
    lens = [256, 384, 512, 256, 40]
    deltas = [sum(lens[:j]) for j in range(len(lens))]
    rot = Rotary(1.0 / (10000.0 ** (torch.arange(0, 64, 2, device=DEV).float() / 64)))
    attn = types.SimpleNamespace(kind={"window": WINDOW, "hca": HCA, "csa-own": CSA, "csa-union": CSA}[kind],
                                 ratio=ratio if kind != "window" else 0, scale=D ** -0.5, rotary=rot, indexer=None,
                                 cfg=types.SimpleNamespace(window_size=W))
    segs = []
    for n, d in zip(lens, deltas):
        lat = torch.randn(n, D, device=DEV, generator=g).to(DT)
        ent = torch.randn(n // ratio, D, device=DEV, generator=g).to(DT) if kind != "window" else None
        segs.append(C.SegmentKeys(d, lat, ent))
    rows = torch.sort(torch.randperm(sum(lens), device=DEV, generator=g)[:700]).values
    q = torch.randn(rows.numel(), H, D, device=DEV, generator=g).to(DT)
    sink = torch.randn(H, device=DEV, generator=g)
    own = None
    if kind == "csa-own":                       # each row's picks among its own segment's entries, -1 padded
        seg_of = torch.searchsorted(torch.tensor(deltas, device=DEV), rows, right=True) - 1
        n_ent = torch.tensor([n // 4 for n in lens], device=DEV)[seg_of]
        own = (torch.rand(rows.numel(), 64, device=DEV, generator=g) * n_ent[:, None]).long()
        own = torch.where(torch.rand(own.shape, device=DEV, generator=g) < 0.2, -1, own)
    per_seg = None
    if kind == "csa-union":                     # per segment 64 picks a row among its entries before the row
        per_seg = []
        for d, seg in zip(deltas, segs):
            vis = ((rows - d + 1).clamp(min=0) // 4).clamp(max=seg.entries.shape[0])
            pk = (torch.rand(rows.numel(), 64, device=DEV, generator=g) * vis[:, None]).long()
            per_seg.append(torch.where(vis[:, None] > 0, pk, -1))
    hostpos = rows.cpu().numpy()
    counted = {"fused": 0, "stacked": 0}
    for name, key in (("multi_segment_attention", "fused"), ("sparse_mqa_parts", "stacked")):
        def count(*a, _real=getattr(C, name), _key=key, **kw):
            counted[_key] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(C, name, count)
    poison()
    policy = RuntimePolicy(fused_min_heads=1) if path == "fused" else \
        RuntimePolicy(fused_min_heads=1, key_frame_min_segments_hca=1) if path == "key" else \
        RuntimePolicy(fused_min_heads=1 << 30, fused_min_segments=1 << 30, key_frame_min_segments_hca=0)
    out, pairs = C.segment_attention(attn, q, rows, segs, sink, qpos_host=hostpos, own_picks=own, picks=per_seg,
                                     policy=policy)
    # one fused launch, or at most two parts launches (window/causal parts, picks parts) for the five segments
    assert (counted["fused"], min(counted["stacked"], 1)) == ((0, 1) if path == "stacked" else (1, 0))
    assert counted["stacked"] <= 2 and out.dtype == DT
    monkeypatch.setenv("REDKNOT_KERNELS", "0")
    up = [C.SegmentKeys(s.delta, s.latent.float(), None if s.entries is None else s.entries.float()) for s in segs]
    before = dict(counted)
    ref, ref_pairs = C.segment_attention(attn, q.float(), rows, up, sink, qpos_host=hostpos, own_picks=own,
                                         picks=per_seg)
    assert counted == before
    assert int(pairs) == int(ref_pairs)
    assert rel_err(out.float(), ref) < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_gather_dequant_kernel_equals_reference(dtype, monkeypatch):
    """The FP8 Local restore's kernel on the device, bit for bit against the torch reference (the scales are powers
    of two and e4m3 fits in bf16, so both are exact)."""
    from .test_interpret import gather_dequant_case
    poison()
    got, want = gather_dequant_case(DEV, dtype, monkeypatch)
    assert torch.equal(got, want)
