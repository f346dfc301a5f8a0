"""Budgets per layer (`ReuseProfile.budget_slope`, issue 31's lever "more rows early, fewer late"): the k-th of R
reusable layers computes the first ceil(b_k x n) rows of the rule's one order, b_k falling linearly from
budget x (1 + slope) to budget x (1 - slope) (mean: the budget), so every layer's rows are a subset of the layer
before's; the last fences that take K/V from the artifacts keep the last reusable layer's rows; both Llama passes
agree; DeepSeek-V4 refuses it; a profile without it binds what it bound before."""
import math

import pytest
import torch

from runtime.eval.arms import parse_arm
from runtime.llama.artifacts import produce_llama
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.loop import run_pass
from runtime.reuse.profile import ProfileError, ReuseProfile
from tests.tiny import tiny_llama, tiny_model

BASE = dict(first_fences=2, last_fences=2, align=1, join_rows=4, recent_rows=8, select="attention")
TOL = 1e-4


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def setup():
    m = tiny_llama().eval()
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (20, 41, 35, 44)]
    question = torch.randint(3, 128, (7,), generator=g).tolist()
    return m, docs, question


def test_layer_budgets_fall_linearly_and_average_the_budget():
    p = ReuseProfile(**BASE, budget=0.4, budget_slope=0.5)
    got = [p.layer_budget(k, 5) for k in range(5)]
    assert got == pytest.approx([0.6, 0.5, 0.4, 0.3, 0.2])
    assert sum(got) / 5 == pytest.approx(0.4)
    assert ReuseProfile(**BASE, budget=0.4).layer_budget(3, 5) == 0.4          # no slope: one budget
    assert p.layer_budget(0, 1) == 0.4                                          # one reusable layer: the budget
    for bad in (dict(budget_slope=-0.1), dict(budget_slope=1.0), dict(budget=0.8, budget_slope=0.5)):
        with pytest.raises(ProfileError, match="budget_slope"):
            ReuseProfile(**{**BASE, "budget": 0.4, **bad})


@torch.inference_mode()
def _traced(eng, path, docs, question):
    """The pass's rows per reusable layer: (layer, mask) at activation and at every narrowing."""
    p = eng.adapter.begin(docs, question) if path == "segments" else eng.adapter.cache_pass(docs, question)
    seen, layer = [], {"i": None}
    for name in ("activate", "narrow", "reusable"):
        orig = getattr(p, name)

        def spy(arg, _orig=orig, _name=name):
            if _name == "reusable":
                layer["i"] = arg
            else:
                seen.append((layer["i"], arg.clone().cpu()))
            return _orig(arg)
        setattr(p, name, spy)
    return run_pass(p), seen


@pytest.mark.parametrize("last_fence_kv", ["recompute", "artifact"])
def test_each_reusable_layer_computes_a_prefix_of_one_order_and_both_passes_agree(setup, last_fence_kv):
    m, docs, question = setup
    prof = ReuseProfile(**BASE, budget=0.3, budget_slope=0.6, last_fence_kv=last_fence_kv)
    arts = [produce_llama(m, d, prof) for d in docs]
    eng = ReuseEngine(m, prof)
    n = sum(len(d) for d in docs[1:])
    R = m.cfg.num_hidden_layers - 4                     # reusable layers 2..5
    want = [min(n, math.ceil(prof.layer_budget(k, R) * n - 1e-9)) for k in range(R)]
    assert len(set(want)) == R                          # the schedule changes at every layer of this shape
    res = {}
    for path in ("segments", "cache"):
        res[path], seen = _traced(eng, path, arts, question)
        # activated before layer 2 (no layer yet), narrowed before layers 3, 4, 5; never in the last fences
        assert [i for i, _ in seen] == [None, 2, 3, 4]
        assert [int(mask.sum()) for _, mask in seen] == want
        for (_, a), (_, b) in zip(seen, seen[1:]):
            assert not (b & ~a).any()                   # nested: a row that drops out never comes back
        # the rows the request reports are the first layer's; the ledger counts them
        chosen = seen[0][1].nonzero().flatten() + len(docs[0])
        assert res[path].active_rows.tolist() == chosen.tolist()
        assert res[path].ledger.active == want[0]
    assert rel_err(res["cache"].logits, res["segments"].logits) <= TOL
    assert res["cache"].ledger.__dict__ == res["segments"].ledger.__dict__


def test_the_slope_is_active_and_costs_what_its_mean_budget_costs(setup):
    """A sloped profile answers differently from the flat one of the same mean budget (the lever is active) at
    nearly the same computed rows: the FLOP ratios agree within the rounding of ceil per layer."""
    m, docs, question = setup
    flat = ReuseProfile(**BASE, budget=0.3)
    sloped = flat.replace(budget_slope=0.6)
    arts = [produce_llama(m, d, flat) for d in docs]
    a = ReuseEngine(m, flat).prefill_cache(arts, question)
    b = ReuseEngine(m, sloped).prefill_cache(arts, question)
    assert rel_err(a.logits, b.logits) > 1e-3
    ra, rb = a.ledger.summary()["flop_ratio"], b.ledger.summary()["flop_ratio"]
    assert abs(ra - rb) / ra < 0.03


def test_deepseek_refuses_and_the_profile_binds_the_slope_only_when_set():
    model = tiny_model()
    prof = ReuseProfile(first_fences=2, last_fences=2, budget=0.25, budget_slope=0.5)
    with pytest.raises(ProfileError, match="Llama family only"):
        prof.check(model.cfg)
    with pytest.raises(ProfileError, match="Llama family only"):
        ReuseEngine(model, prof)
    assert "budget_slope" not in ReuseProfile().to_dict()       # certified before the lever: still matches
    assert prof.to_dict()["budget_slope"] == 0.5 and ReuseProfile(**prof.to_dict()) == prof
    arm = parse_arm("reuse@0.25:slope=0.5")
    assert arm.name == "reuse@25%:slope=0.5" and arm.profile(ReuseProfile(align=1)).budget_slope == 0.5
    assert parse_arm("reuse@0.25:slope=0").name == "reuse@25%"
