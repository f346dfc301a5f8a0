"""The harness end to end on a tiny random Llama (SmolLM2's tokenizer and chat template, no trained weights)
over a synthetic task: the near-tie metrics are reported for every arm within their ranges, the recompute arm
agrees with itself exactly, the exact prefix-only arm agrees to rounding, and the fast path's teacher-forced
numbers equal the reference path's (the engine's own decode fed the recompute tokens)."""
import pytest
import torch

from runtime.eval.data import load_task
from runtime.eval.harness import markdown, run_eval, teacher_positions
from runtime.llama.config import LlamaConfig
from runtime.llama.model import Llama
from runtime.llama.tokenizer import ChatTokenizer

NEW = ("tf_top1", "tf_kl", "answer_f1", "span_agreement")


@pytest.fixture(scope="module")
def tiny(smollm2_dir):
    tok = ChatTokenizer.from_dir(smollm2_dir)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=6, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,), tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Llama(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model.eval(), tok


@pytest.fixture(scope="module")
def runs(tiny):
    model, tok = tiny
    ex = list(load_task("kv_retrieval", limit=2))
    kw = dict(max_new_tokens=6, fences=(1, 1), teacher_tokens=5)
    return ex, run_eval(model, tok, ex, [0.25], **kw), run_eval(model, tok, ex, [0.25], reference=True, **kw)


def test_teacher_positions():
    assert teacher_positions([5, 6, 7], cap=32, window=32) == 4          # the stop prediction counts
    assert teacher_positions([5, 6, 7], cap=3, window=32) == 3           # cut at the cap: no stop seen
    assert teacher_positions([], cap=32, window=32) == 1
    assert teacher_positions(list(range(40)), cap=40, window=32) == 32


def test_new_metrics_are_reported_within_range(runs):
    _, fast, _ = runs
    arms = fast["arms"]
    assert set(arms) == {"recompute", "prefix-only", "naive", "reuse@25%"}
    for name, r in arms.items():
        for k in NEW:
            lo, hi = r["ci"][k]
            assert lo <= r[k] <= hi, (name, k)
        assert 0 <= r["tf_top1"] <= 1 and 0 <= r["answer_f1"] <= 1 and 0 <= r["span_agreement"] <= 1, name
        assert r["tf_kl"] >= 0, name
    assert set(arms["reuse@25%"]["vs_naive"]) >= set(NEW)
    table = markdown(fast, "kv_retrieval")
    assert "teacher-forced top-1" in table and "| reuse@25% | " in table and "reuse arm - naive" in table


def test_recompute_agrees_with_itself_exactly(runs):
    _, fast, ref = runs
    for s in (fast, ref):
        r = s["arms"]["recompute"]
        assert (r["tf_top1"], r["tf_kl"], r["answer_f1"], r["span_agreement"]) == (1.0, 0.0, 1.0, 1.0)
        p = s["arms"]["prefix-only"]                                      # exact reuse: equal up to rounding
        assert p["tf_top1"] == 1.0 and p["tf_kl"] < 1e-6


def test_fast_teacher_forcing_equals_the_reference(runs):
    _, fast, ref = runs
    for name, r in ref["raw"].items():
        f = fast["raw"][name]
        assert f["answers"] == r["answers"], name
        assert f["tf_top1"] == r["tf_top1"], name
        assert f["tf_kl"] == pytest.approx(r["tf_kl"], abs=1e-4), name
