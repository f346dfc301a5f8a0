"""The last layer of a prefill computes the last row's output only (Block.forward(out_rows=1)): the next token's
logits and every layer's cache equal a full pass's, decoding continues the same, and the FLOP model counts what
runs. The full last layer they are compared with: `all_logits=True` (every row's logits), or the rule
`prefill_out_rows` replaced where the ledger and the reuse engine read it."""
import pytest
import torch

from runtime.model.config import tiny_reuse
from runtime.model.deepseek_v4 import prefill_out_rows
from runtime.model.flops import layer_flops
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.ledger import Ledger
from runtime.reuse.producer import produce
from runtime.reuse.profile import ReuseProfile
from tests.tiny import tiny_model

CFG = tiny_reuse()
# float32 on the CPU: the last row's products run in a GEMM of 1 row instead of T rows, whose blocking may sum in
# another order; measured differences are ~1e-7 relative
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return tiny_model(CFG, seed=5)


def _on(device):
    """The model on `device` (float32; on CUDA with the Triton kernels: the fast path's trimmed last layer)."""
    return tiny_model(CFG, seed=5, device="cuda") if device == "cuda" else None


def _tokens(n, seed=0):
    return torch.randint(2, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _cache_tensors(cache):
    """Every tensor a layer's cache holds, by name (window rows, compressor and indexer states)."""
    out = {}
    for i, lc in enumerate(cache.layers):
        out[f"{i}.window_kv"] = lc.window_kv
        for part in ("compressor", "indexer"):
            st = getattr(lc, part)
            for k, v in vars(st).items():
                if isinstance(v, torch.Tensor):
                    out[f"{i}.{part}.{k}"] = v
    return out


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_last_layer_on_the_last_row_keeps_logits_and_every_cache(model, monkeypatch, device):
    model = _on(device) or model
    toks = _tokens(150).to(device)
    full_cache, trim_cache = model.new_cache(), model.new_cache()
    full = model(toks, full_cache, all_logits=True)[-1]            # every row through the last layer
    assert prefill_out_rows(CFG, CFG.n_layers - 1) == 1 and prefill_out_rows(CFG, 0) is None
    calls = []
    last = model.layers[-1]
    real = type(last).forward
    monkeypatch.setattr(type(last), "forward", lambda self, *a, **k: (calls.append((self.layer, k.get("out_rows"))),
                                                                       real(self, *a, **k))[1])
    trim = model(toks, trim_cache)
    # the approximation is active: only the last layer was asked for one row
    assert calls[-1] == (CFG.n_layers - 1, 1) and all(r is None for _, r in calls[:-1])
    # (on CUDA a 1-row GEMM is another cuBLAS kernel than a 150-row one: 1e-4)
    assert _rel(trim, full) <= (TOL if device == "cpu" else 1e-4) and int(trim.argmax()) == int(full.argmax())
    a, b = _cache_tensors(full_cache), _cache_tensors(trim_cache)
    assert a.keys() == b.keys() and len(a) > CFG.n_layers
    for k in a:                      # every row fed every cache through the same arithmetic: bit-equal
        assert (a[k] is None) == (b[k] is None), k
        if a[k] is not None:
            assert torch.equal(a[k], b[k]), k
    assert full_cache.pos == trim_cache.pos == 150
    # decoding goes on from either cache the same way (each decode step is one row: nothing to trim)
    nxt = torch.tensor([int(full.argmax())], device=device)
    assert torch.equal(model(nxt, full_cache), model(nxt, trim_cache))


def test_all_logits_and_a_capturing_producer_keep_every_row(model):
    toks = _tokens(80, seed=1)
    every = model(toks, all_logits=True)
    assert every.shape == (80, CFG.vocab_size)
    assert _rel(model(toks), every[-1]) <= TOL
    cache = model.new_cache()
    cache.layers[-1].capture = {}
    assert prefill_out_rows(CFG, CFG.n_layers - 1, cache.layers[-1]) is None
    model(toks, cache)
    assert cache.layers[-1].capture["o"].shape[0] == 80           # the producer saw every row's output


def test_chunked_prefill_trims_each_chunk_and_equals_one_pass(model):
    toks = _tokens(160, seed=2)
    one = model.prefill(toks, model.new_cache())
    c = model.new_cache()
    chunked = model.prefill(toks, c, chunk=48)
    assert _rel(chunked, one) <= 1e-4 and c.pos == 160


def test_block_out_rows_bounds(model):
    blk = model.layers[-1]
    x = model.embed_streams(_tokens(40, seed=3))
    pos = torch.arange(40)
    with torch.inference_mode():
        full = blk(x, _tokens(40, seed=3), pos, model.new_cache().layers[-1], model.q_chunk)
        for r in (1, 7, 40, 100):
            got = blk(x, _tokens(40, seed=3), pos, model.new_cache().layers[-1], model.q_chunk, out_rows=r)
            n = min(r, 40)
            assert got.shape == (n, *x.shape[1:]) and _rel(got, full[-n:]) <= TOL
        none = blk(x, _tokens(40, seed=3), pos, model.new_cache().layers[-1], model.q_chunk, out_rows=0)
        assert none.shape == (0, *x.shape[1:])


def test_flops_of_the_trimmed_layer():
    last = CFG.n_layers - 1
    T = 4096
    full, trim = layer_flops(CFG, last, T), layer_flops(CFG, last, T, out_rows=1)
    assert layer_flops(CFG, last, T, out_rows=T) == full
    c = CFG
    d, D, H, R, hc = c.dim, c.head_dim, c.n_heads, c.o_lora_rank, c.hc_mult
    mix = (2 + hc) * hc * hc * d                                   # one mHC site, per row
    comp = 2 * 2 * d * D * (2 if c.layer_kind(last) == "csa" else 1) if c.compress_ratios[last] else 0
    every_row = 2 * d * D + 2 * mix + comp                         # W_kv, the attention-site mix, the compressors
    one_row = 2 * (d * c.q_lora_rank + c.q_lora_rank * H * D + H * D * R + c.o_groups * R * d) + 2 * mix
    assert trim.projections == pytest.approx(T * every_row + one_row)
    one = layer_flops(CFG, last, 1, start=T - 1)                   # the last row's attention and MoE, as if alone
    assert trim.attention == one.attention and trim.moe == one.moe
    assert trim.total < full.total / 5


def test_the_ledgers_recompute_arm_counts_the_trimmed_last_layer(monkeypatch):
    led = Ledger.start(CFG, ReuseProfile(first_fences=2, last_fences=2, align=16), n_prefix=64, n_reloc=256, n_new=16)
    trimmed = sum(led.recompute_flops().values())
    import runtime.reuse.ledger as ledger_mod
    monkeypatch.setattr(ledger_mod, "prefill_out_rows", lambda *a: None)     # every row through the last layer
    full = sum(led.recompute_flops().values())
    T, last = 64 + 256 + 16, CFG.n_layers - 1
    assert full - trimmed == pytest.approx(layer_flops(CFG, last, T).total - layer_flops(CFG, last, T, out_rows=1).total)


def test_reuse_arm_trims_its_last_fence_and_keeps_its_caches(model, monkeypatch):
    prof = ReuseProfile(first_fences=2, last_fences=2, align=16, budget=0.25)
    g = torch.Generator().manual_seed(7)
    docs = [produce(model, torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist(), prof) for n in (64, 96, 80)]
    question = torch.randint(2, CFG.vocab_size, (12,), generator=g).tolist()
    eng = ReuseEngine(model, prof)
    import runtime.reuse.deepseek as engine_mod
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_mod, "prefill_out_rows", lambda *a: None)        # every row through the last fence
        a = eng.prefill(docs, question)
    b = eng.prefill(docs, question)
    assert _rel(b.logits, a.logits) <= TOL
    last = CFG.n_layers - 1
    ca, cb = a.state.fence_caches[last], b.state.fence_caches[last]
    assert torch.equal(ca.window_kv, cb.window_kv)
    assert torch.equal(ca.compressor.entries, cb.compressor.entries) if ca.compressor.entries is not None else True
    # the ledger's reuse arm counts the trimmed fence: fewer FLOPs, the same structural savings
    sa, sb = a.ledger.summary(), b.ledger.summary()
    assert sum(b.ledger.reuse_flops.values()) < sum(a.ledger.reuse_flops.values())
    assert sa["head_row_saving"] == sb["head_row_saving"] and sa["token_row_saving"] == sb["token_row_saving"]
    nxt = int(a.logits.argmax())
    assert _rel(eng.decode(b.state, nxt), eng.decode(a.state, nxt)) <= TOL
