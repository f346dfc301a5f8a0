"""`sink_rows` (issue 31's lever on each document's own first rows): the first rows of every relocated document
are chosen active before the profile's rule spends the rest of the budget, under every rule and both model
families; the budget is unchanged; a profile without it binds what it bound before."""
import pytest
import torch

from runtime.eval.arms import parse_arm
from runtime.llama.artifacts import produce_llama
from runtime.llama.model import Llama
from runtime.reuse.controller import choose, sink_mask
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.producer import produce
from runtime.reuse.profile import ProfileError, ReuseProfile
from tests.tiny import TINY_LLAMA, tiny_model

SEGS = [40, 25, 60]


@pytest.mark.parametrize("select", ["mixed", "deviation", "attention"])
def test_every_rule_takes_the_sink_rows_first_within_the_budget(select):
    n = sum(SEGS)
    g = torch.Generator().manual_seed(0)
    dev, draft = torch.rand(n, generator=g), torch.rand(n, generator=g)
    base = ReuseProfile(first_fences=2, last_fences=2, align=1, join_rows=4, recent_rows=8, budget=0.2, select=select)
    plain = choose(base, dev, None, lambda: draft, SEGS, [10, 50, 75], 135, 5)
    sunk = choose(base.replace(sink_rows=3), dev, None, lambda: draft, SEGS, [10, 50, 75], 135, 5)
    starts = torch.tensor([0, 40, 65])
    sinks = (starts[:, None] + torch.arange(3)).flatten()
    assert sink_mask(base.replace(sink_rows=3), SEGS, "cpu").nonzero().flatten().tolist() == sinks.tolist()
    assert sunk[sinks].all() and int(sunk.sum()) == int(plain.sum()) == 25        # ceil(0.2 x 125)
    if select != "mixed":               # the rest of the budget is the rule's own top rows
        score = dev if select == "deviation" else draft
        rest = sunk.clone()
        rest[sinks] = False
        others = torch.ones(n, dtype=torch.bool)
        others[sinks] = False
        assert score[rest].min() >= score[others & ~rest].max()
    # more sink rows than the budget: the budget is all sinks, never more
    assert int(choose(base.replace(sink_rows=20), dev, None, lambda: draft, SEGS, [10, 50, 75], 135, 5).sum()) == 25
    # no relocated document (the prefix alone): no candidate, no sink row
    none = choose(base.replace(sink_rows=3), torch.zeros(0), None, lambda: torch.zeros(0), [], [], 40, 5)
    assert none.numel() == 0 and sink_mask(base.replace(sink_rows=3), [], "cpu").numel() == 0


def test_the_engines_of_both_families_recompute_the_sink_rows():
    prof = ReuseProfile(first_fences=2, last_fences=2, align=16, join_rows=4, recent_rows=8, budget=0.25,
                        select="attention", sink_rows=2)
    model = tiny_model(seed=1)
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(2, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (48, 64, 32)]
    question = torch.randint(2, model.cfg.vocab_size, (8,), generator=g).tolist()
    arts = [produce(model, d, prof) for d in docs]
    res = ReuseEngine(model, prof).prefill(arts, question)
    n0 = arts[0].n
    for start in (n0, n0 + arts[1].n):            # each relocated document's first two rows
        assert {start, start + 1} <= set(res.active_rows.tolist())
    torch.manual_seed(0)
    lm = Llama(TINY_LLAMA).eval()
    lprof = prof.replace(align=1)
    ldocs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (30, 41, 25)]
    larts = [produce_llama(lm, d, lprof) for d in ldocs]
    lq = torch.randint(3, 128, (6,), generator=g).tolist()
    for r in (ReuseEngine(lm, lprof).prefill(larts, lq), ReuseEngine(lm, lprof).prefill_cache(larts, lq)):
        assert {30, 31, 71, 72} <= set(r.active_rows.tolist())


def test_the_profile_binds_sink_rows_only_when_set_and_the_harness_names_it():
    base = ReuseProfile(align=1)
    assert "sink_rows" not in base.to_dict()              # what was certified before the lever still matches
    assert base.replace(sink_rows=4).to_dict()["sink_rows"] == 4
    assert ReuseProfile(**base.replace(sink_rows=4).to_dict()).sink_rows == 4
    with pytest.raises(ProfileError, match="sink_rows"):
        base.replace(sink_rows=-1)
    arm = parse_arm("reuse@0.25:sink=4")
    assert arm.name == "reuse@25%:sink=4" and arm.profile(base).sink_rows == 4
    assert parse_arm("reuse@0.25:sink=0").name == "reuse@25%"
