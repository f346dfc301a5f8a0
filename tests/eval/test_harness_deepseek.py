"""The quality harness on DeepSeek-V4 (issue 31 item 3, with the one engine of issue 30): `run_eval` runs the
profile the model serves, with that profile's own rule, through the same engine the worker runs; every arm sees
the same padded documents; the table says which rule and profile it measured."""
import pytest

from runtime.eval.harness import markdown, merge_runs, run_eval
from runtime.eval.synthetic import load_synthetic
from runtime.llama.tokenizer import ChatTokenizer
from runtime.model.checkpoint import build_demo_tokenizer
from runtime.model.config import tiny_reuse
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.producer import pad_document, produce
from runtime.reuse.profile import ReuseProfile
from tests.tiny import tiny_model

CFG = tiny_reuse()
PROF = ReuseProfile(name="served", first_fences=2, last_fences=2, align=16, budget=0.25, recent_rows=16, join_rows=8)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_demo_tokenizer(CFG.vocab_size, d)
    tok = ChatTokenizer.from_dir(d)
    examples = list(load_synthetic("kv_retrieval", limit=2, seed=3))
    return tiny_model(CFG), tok, examples


def test_the_harness_runs_the_served_profile_and_its_rule_on_deepseek_v4(setup):
    model, tok, examples = setup
    s = run_eval(model, tok, examples[:1], [0.25], max_new_tokens=3, teacher_tokens=3, profile=PROF,
                 variants=["reuse@25%:select=deviation"])
    # no naive arm on V4; a variant with another rule is measured under its own name, on the same profile otherwise
    assert set(s["arms"]) == {"recompute", "prefix-only", "reuse@25%", "reuse@25%:select=deviation"}
    assert s["profile"]["family"] == "deepseek_v4" and s["profile"]["select"] == "mixed"
    assert s["profile"]["name"] == "served" and s["profile"]["align"] == 16
    r25 = s["arms"]["reuse@25%"]
    assert r25["flop_ratio"] > 1 and 0 < r25["token_row_saving"] < 1     # the reuse arm really reused, by the ledger
    # the reuse arm's first-token logits are the engine's own on the same padded documents (what the worker runs)
    raw = s["raw"]["reuse@25%"]
    from runtime.eval.harness import layout
    lay = layout(tok, examples[0])
    arts = [produce(model, pad_document(seg, PROF.align, CFG.eos_token_id), PROF) for seg in lay.segments]
    ids, res = ReuseEngine(model, PROF).generate(arts, lay.question, 3)
    assert raw["answers"][0] == tok.decode(ids).strip()
    assert raw["kl"][0] >= 0 and s["arms"]["recompute"]["first_token_kl"] == 0
    # the table names the family, profile and rule it measured
    table = markdown(s, "kv_retrieval")
    assert "Model family deepseek_v4, profile `served`: rule `select=mixed`, fences 2+2" in table
    # runs of one profile merge; runs of different profiles do not
    one = run_eval(model, tok, examples[1:], [0.25], max_new_tokens=3, teacher_tokens=3, profile=PROF,
                   variants=["reuse@25%:select=deviation"])
    assert merge_runs([s, one])["profile"] == s["profile"] and merge_runs([s, one])["n"] == 2
    with pytest.raises(ValueError, match="different profiles"):
        merge_runs([s, dict(one, profile=dict(one["profile"], name="other"))])


def test_a_deepseek_model_needs_the_profile_it_serves(setup):
    model, tok, examples = setup
    with pytest.raises(ValueError, match="profile it serves"):
        run_eval(model, tok, examples[:1], [0.25], max_new_tokens=2)
    with pytest.raises(Exception, match="align"):
        run_eval(model, tok, examples[:1], [0.25], max_new_tokens=2, profile=PROF.replace(align=3))


def test_redknot_eval_runs_a_deepseek_checkpoint_under_its_profile(tmp_path):
    """`redknot eval --model <DeepSeek-V4 checkpoint> --profile demo`: the checkpoint loads as V4, the table names
    the demo profile and its rule; without --profile the command says what it needs and runs nothing."""
    import json

    from runtime.eval.cli import main as eval_main
    from runtime.model.config import demo
    from runtime.model.random_init import write_random_checkpoint
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    build_demo_tokenizer(512, tok)
    ckpt = write_random_checkpoint(tmp_path / "ckpt", demo(512), seed=0, device="cpu", tokenizer_json=tok)
    out = tmp_path / "run.json"
    common = ["--task", "kv_retrieval", "--model", str(ckpt), "--limit", "1", "--budgets", "0.25",
              "--max-new-tokens", "2", "--teacher-tokens", "2", "--device", "cpu"]
    assert eval_main(common) == 2 and not out.exists()
    assert eval_main(common + ["--profile", "demo", "--out", str(out)]) == 0
    s = json.loads(out.read_text())
    assert set(s["arms"]) == {"recompute", "prefix-only", "reuse@25%"}
    assert s["profile"]["family"] == "deepseek_v4" and s["profile"]["name"] == "demo"
    assert "profile `demo`: rule `select=mixed`, fences 2+2" in out.with_suffix(".md").read_text()
