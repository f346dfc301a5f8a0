"""The reuse path on a Llama-family model (GQA, whole-head RoPE, no output RoPE, W_o sliced by heads): exact
where the math is exact, measurably approximate elsewhere; naive reuse runs as the skeptic's baseline."""
import pytest
import torch

from runtime.llama.config import LlamaConfig
from runtime.llama.model import Llama
from runtime.reuse.llama_engine import LlamaReuseEngine, produce_llama
from runtime.reuse.profile import ReuseProfile

TOL = 1e-4
CFGS = {
    "llama": LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=500.0, bos_token_id=1,
                         eos_token_ids=(2,), model_type="llama"),
    "qwen2-bias": LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=8,
                              num_attention_heads=6, num_key_value_heads=2, rope_theta=500.0, bos_token_id=1,
                              eos_token_ids=(2,), model_type="qwen2", qkv_bias=True),
}
BASE = dict(first_fences=2, last_fences=2, align=1, join_rows=4, recent_rows=8)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=list(CFGS))
def setup(request):
    torch.manual_seed(0)
    m = Llama(CFGS[request.param])
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.15)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (30, 41, 25, 33)]
    question = torch.randint(3, 128, (9,), generator=g).tolist()
    return m.eval(), docs, question


def full(m, docs, question):
    return m(torch.tensor([t for d in docs for t in d] + question))


def test_degenerate_profile_equals_full_recompute_prefill_and_decode(setup):
    m, docs, question = setup
    G = m.cfg.num_attention_heads // m.cfg.num_key_value_heads
    prof = ReuseProfile(**BASE, budget=1.0, global_per_group=G, ffn_mode="native")
    arts = [produce_llama(m, d, prof) for d in docs]
    eng = LlamaReuseEngine(m, prof)
    logits, state, _ = eng.prefill(arts, question)
    cache = m.new_cache()
    ref = m.prefill(torch.tensor([t for d in docs for t in d] + question), cache)
    assert rel_err(logits, ref) <= TOL
    for _ in range(3):
        nxt = int(ref.argmax())
        got, ref = eng.decode(state, nxt), m(torch.tensor([nxt]), cache)
        assert rel_err(got, ref) <= TOL


def test_prefix_plus_question_is_exact(setup):
    m, docs, question = setup
    prof = ReuseProfile(**BASE, budget=0.1)
    logits, _, _ = LlamaReuseEngine(m, prof).prefill([produce_llama(m, docs[0], prof)], question)
    assert rel_err(logits, full(m, docs[:1], question)) <= TOL


def test_reuse_is_approximate_and_counted_naive_is_cheaper(setup):
    m, docs, question = setup
    prof = ReuseProfile(**BASE, budget=0.25)
    arts = [produce_llama(m, d, prof) for d in docs]
    ref = full(m, docs, question)
    logits, _, led = LlamaReuseEngine(m, prof).prefill(arts, question)
    s = led.summary()
    n_reloc = sum(len(d) for d in docs[1:])
    assert s["rows"]["active"] == -(-n_reloc // 4)
    assert rel_err(logits, ref) > 1e-3
    R, L, H = 8 - 4, 8, m.cfg.num_attention_heads
    Hg = m.cfg.num_key_value_heads
    skipped = (n_reloc - s["rows"]["active"]) * R
    assert s["token_row_saving"] == pytest.approx(skipped / (n_reloc * L))
    assert s["head_row_saving"] == pytest.approx(skipped * (H - Hg) / (n_reloc * L * H))
    nl, _, nled = LlamaReuseEngine(m, prof, mode="naive").prefill(arts, question)
    assert nled.summary()["head_row_saving"] == 1.0 and nled.summary()["flop_ratio"] > s["flop_ratio"] > 1
    assert torch.isfinite(nl).all() and rel_err(nl, ref) > 1e-3


def test_certificate_binding_is_checked(setup):
    m, docs, question = setup
    prof = ReuseProfile(**BASE, budget=0.25)
    arts = [produce_llama(m, d, prof) for d in docs]
    assert LlamaReuseEngine(m, prof).verify(arts).ok
    assert LlamaReuseEngine(m, prof.replace(budget=0.2)).verify(arts).reason.value == "profile_mismatch"
    arts[1].tokens = arts[1].tokens[:-1] + [5]
    assert LlamaReuseEngine(m, prof).verify(arts).reason.value == "token_mismatch"
