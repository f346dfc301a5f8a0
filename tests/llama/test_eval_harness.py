"""`redknot eval`'s harness on the real SmolLM2 and real HotpotQA data: every arm runs on the same tokens; the
prefix-only arm is exact; the reuse arm really reuses (counted savings); chunks merge; fallbacks reject a run."""
import itertools

import pytest

from runtime.eval.data import load_task
from runtime.eval.harness import EvalRejected, layout, merge_runs, run_eval
from runtime.llama.tokenizer import ChatTokenizer


@pytest.fixture(scope="module")
def run(smollm2, smollm2_dir):
    tok = ChatTokenizer.from_dir(smollm2_dir)
    ex = list(itertools.islice(load_task("hotpotqa"), 2))
    ex = [ex[0].__class__(**{**ex[0].__dict__, "paragraphs": ex[0].paragraphs[:4]}),
          ex[1].__class__(**{**ex[1].__dict__, "paragraphs": ex[1].paragraphs[:4]})]
    return tok, ex, run_eval(smollm2, tok, ex[:1], [0.25], max_new_tokens=3, fences=(3, 3))


def test_layout_is_the_chat_prompt(run):
    tok, ex, _ = run
    lay = layout(tok, ex[0])
    text = tok.decode([t for s in lay.segments for t in s] + lay.question, skip_special_tokens=False)
    assert len(lay.segments) == 4 and ex[0].question in text and text.rstrip().endswith("assistant")


def test_arms_and_namespaces(run):
    _, _, s = run
    arms = s["arms"]
    assert set(arms) == {"recompute", "prefix-only", "naive", "reuse@25%"}
    assert arms["prefix-only"]["agreement"] == 1.0 and arms["prefix-only"]["first_token_kl"] < 1e-6
    ceiling = 24 / 30 * 6 / 9                       # SmolLM2: 3+3 fences of 30 layers, 6 Local of 9 heads
    assert 0 < arms["reuse@25%"]["head_row_saving"] <= 0.75 * ceiling + 1e-3
    assert arms["naive"]["head_row_saving"] == 1.0
    assert arms["naive"]["flop_ratio"] > arms["reuse@25%"]["flop_ratio"] > 1


def test_chunks_merge_and_must_not_overlap(run, smollm2):
    tok, ex, first = run
    second = run_eval(smollm2, tok, ex[1:], [0.25], max_new_tokens=3, fences=(3, 3))
    merged = merge_runs([first, second])
    assert merged["n"] == 2 and "f1_delta" in merged["arms"]["reuse@25%"]
    with pytest.raises(ValueError, match="overlap"):
        merge_runs([first, first])


def test_a_fallback_rejects_the_run(run, smollm2, monkeypatch):
    tok, ex, _ = run
    from runtime.reuse.engine import ReuseEngine
    from runtime.reuse.certificate import FallbackReason, Verdict
    monkeypatch.setattr(ReuseEngine, "verify",
                        lambda self, docs: Verdict.reject(FallbackReason.DIGEST_MISMATCH, "planted"))
    with pytest.raises(EvalRejected, match="digest_mismatch"):
        run_eval(smollm2, tok, ex[:1], [0.25], max_new_tokens=2)


def test_fast_path_equals_the_reference_path(run, smollm2):
    """The harness's shared-work path (one forward per document for every profile, relocated K/V shared, each
    arm's prefill on its own cache, one batched decode) against each arm run alone as first written: the same
    answers, the same ledgers, first-token KLs equal to 1e-4."""
    tok, ex, fast = run
    ref = run_eval(smollm2, tok, ex[:1], [0.25], max_new_tokens=3, fences=(3, 3), reference=True)
    for name, r in ref["raw"].items():
        f = fast["raw"][name]
        assert f["answers"] == r["answers"], name
        assert f["head_row"] == r["head_row"] and f["token_row"] == r["token_row"], name
        assert f["flop_ratio"] == r["flop_ratio"], name
        assert abs(f["kl"][0] - r["kl"][0]) <= 1e-4, name
