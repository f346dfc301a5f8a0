"""Our DeepSeek-V4 against transformers' DeepseekV4ForCausalLM on the same random weights (CPU, float32).

Tolerance: max |ours - theirs| / max |theirs| <= 1e-4 over all logits of all rows."""
import pytest
import torch

from runtime.model.checkpoint import random_state, write_official_checkpoint
from runtime.model.config import tiny
from runtime.model.deepseek_v4 import Transformer
from runtime.model.loader import load_model
from tests.runtime.hf_oracle import hf_model_from_state
from tests.tiny import tiny_model

TOL = 1e-4

CONFIGS = {
    # window-only layers, every MoE layer hash-routed
    "window-only": (tiny(n_layers=3, compress_ratios=(0, 0, 0), n_hash_layers=3), 120),
    # window + CSA (ratio 4, overlapping blocks, indexer top-4 of many) + HCA (ratio 16); hash then scored MoE
    "mixed": (tiny(n_layers=6), 200),
    # the real window (128) and real ratios (4 / 128): 300 rows cross the window and two HCA blocks
    "real-ratios": (tiny(n_layers=4, window_size=128, compress_ratios=(0, 4, 128, 4), n_hash_layers=1,
                         index_topk=16), 300),
    # indexer top-k larger than the number of entries: every ready block is selected
    "topk-covers-all": (tiny(n_layers=3, compress_ratios=(4, 16, 4), n_hash_layers=2, index_topk=512), 96),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    cfg, T = CONFIGS[request.param]
    state = random_state(cfg, seed=1)
    hf = hf_model_from_state(cfg, state)
    tokens = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(tokens[None], use_cache=False).logits[0]
    path = tmp_path_factory.mktemp(request.param)
    write_official_checkpoint(path / "official", cfg, state, quantize=False)
    hf.save_pretrained(path / "hf")
    return cfg, state, tokens, ref, path


def test_matches_transformers_official_layout(case):
    cfg, _, tokens, ref, path = case
    model = load_model(path / "official")
    assert rel_err(model(tokens, all_logits=True), ref) <= TOL


def test_matches_transformers_hf_layout(case):
    cfg, _, tokens, ref, path = case
    model = load_model(path / "hf")
    assert model.cfg == cfg
    assert rel_err(model(tokens, all_logits=True), ref) <= TOL


def test_chunked_prefill_and_decode_equal_one_shot(case):
    cfg, _, tokens, ref, path = case
    model = load_model(path / "official")
    T = tokens.shape[0]
    split = T - 8
    cache = model.new_cache()
    rows = []
    for a in range(0, split, 37):                       # odd chunk size: chunks straddle windows and blocks
        rows.append(model(tokens[a:min(a + 37, split)], cache, all_logits=True))
    for t in range(split, T):                            # then one token at a time, as in decoding
        rows.append(model(tokens[t:t + 1], cache, all_logits=True))
    assert cache.pos == T
    assert rel_err(torch.cat(rows), ref) <= TOL


def test_quantized_official_checkpoint_matches_transformers(tmp_path):
    """FP8 block-scaled weights and FP4 experts on disk, dequantized on load: the same logits as transformers
    holding the dequantized values (weights drawn so that quantization is exact)."""
    cfg, T = CONFIGS["mixed"]
    state = random_state(cfg, seed=3, exact_quant=True)
    hf = hf_model_from_state(cfg, state)
    tokens = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(tokens[None], use_cache=False).logits[0]
    write_official_checkpoint(tmp_path, cfg, state, quantize=True)
    model = load_model(tmp_path)
    assert rel_err(model(tokens, all_logits=True), ref) <= TOL


def test_greedy_generation_matches_transformers():
    cfg, _ = CONFIGS["mixed"]
    state = random_state(cfg, seed=5)
    hf = hf_model_from_state(cfg, state)
    model = Transformer(cfg)
    model.load_state_dict(state)
    tokens = torch.randint(2, cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(6))
    ours, _ = model.generate(tokens, max_new_tokens=12, chunk=25, eos=-1)
    seq = tokens.tolist()
    for _ in range(12):                                  # transformers, recomputing the whole prefix each step
        with torch.no_grad():
            seq.append(int(hf(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    assert ours == seq[60:]


def test_fp8_activation_simulation_is_a_switch():
    """Off by default; on, the inputs of the FP8 linears are rounded to e4m3 (3 mantissa bits, ~6% per
    element), so logits of this random 6-layer model move measurably but stay strongly correlated."""
    cfg, T = CONFIGS["mixed"]
    assert cfg.quant_sim is False
    state = random_state(cfg, seed=9)
    plain, sim = Transformer(cfg), Transformer(cfg.replace(quant_sim=True))
    plain.load_state_dict(state)
    sim.load_state_dict(state)
    tokens = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(10))
    a, b = plain(tokens, all_logits=True), sim(tokens, all_logits=True)
    assert rel_err(b, a) > 1e-3
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.95
    lin = sim.layers[0].attn.wq_a
    x = torch.randn(5, cfg.dim)
    from runtime.model.quant import fake_quant_fp8_act
    assert torch.equal(lin(x), torch.nn.functional.linear(fake_quant_fp8_act(x), lin.weight))


def test_moe_routed_equals_a_pass_per_expert():
    """MoE.routed groups (row, slot) pairs by one stable sort (one host read per call): the result is bitwise the
    per-expert `torch.where(idx == e)` formulation it replaced, dropped slots (-1) included."""
    cfg = tiny(n_layers=2)
    m = tiny_model(cfg, seed=3)
    moe = m.layers[1].ffn
    g = torch.Generator().manual_seed(0)
    x = torch.randn(97, cfg.dim, generator=g)
    w, idx = moe.gate(x, torch.randint(0, cfg.vocab_size, (97,), generator=g))
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.3, torch.full_like(idx, -1), idx)
    want = torch.zeros(x.shape)
    for e in range(cfg.n_routed_experts):
        rows, slot = torch.where(idx == e)
        if rows.numel():
            want.index_add_(0, rows, moe.experts[str(e)](x[rows], w[rows, slot, None]).float())
    got = moe.routed(x, w, idx)
    assert (idx >= 0).any() and (idx < 0).any()
    assert torch.equal(got, want)
