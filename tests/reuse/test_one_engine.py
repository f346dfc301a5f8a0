"""One reuse engine over model adapters (issue 30): the request loop's order (fences, one choice of rows at the
first reusable layer, reusable layers), one engine class for DeepSeek-V4 and the Llama family with the same
result type and the same rule, and clear refusals where a family has no such path."""
import pytest
import torch

from runtime.llama.artifacts import produce_llama
from runtime.llama.config import LlamaConfig
from runtime.llama.model import Llama
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.loop import Pass, ReuseResult, run_pass
from runtime.reuse.producer import produce
from runtime.reuse.profile import ReuseProfile
from tests.tiny import tiny_model


class Recorded(Pass):
    """A pass that records what the loop asks of it (the layer math is the adapters', tested elsewhere)."""

    def __init__(self, prof, fences: set[int]):
        super().__init__(prof, [4, 6, 6], [0, 4, 10], 3, 6, "cpu")
        self.fences, self.calls = fences, []
        self.deviation = torch.arange(self.n_reloc, dtype=torch.float32)

    def is_fence(self, i):
        return i in self.fences

    def fence(self, i, signals):
        self.calls.append(("fence", i, signals))

    def draft(self):
        self.calls.append(("draft",))
        return -torch.arange(self.n_reloc, dtype=torch.float32)        # the first rows score highest

    def activate(self, active):
        self.active = active
        self.calls.append(("activate", tuple(active.nonzero().flatten().tolist())))

    def reusable(self, i):
        self.calls.append(("reusable", i))

    def finish(self):
        return ReuseResult(torch.zeros(1), None, self.active.nonzero().flatten(), None)


def test_the_loop_runs_fences_then_chooses_once_then_reusable_layers():
    prof = ReuseProfile(first_fences=1, last_fences=1, align=1, budget=0.25, select="attention")
    p = Recorded(prof, {0, 5})
    run_pass(p)
    assert p.calls == [("fence", 0, True), ("draft",), ("activate", (0, 1, 2)), ("reusable", 1), ("reusable", 2),
                       ("reusable", 3), ("reusable", 4), ("fence", 5, False)]
    # the caller's rows replace the rule (no draft); the naive arm chooses none; both at once is refused
    given = torch.zeros(12, dtype=torch.bool)
    given[7] = True
    p = Recorded(prof, {0, 5})
    run_pass(p, given)
    assert ("draft",) not in p.calls and ("activate", (7,)) in p.calls
    p = Recorded(prof, set())
    run_pass(p, naive=True)
    assert p.calls[0] == ("activate", ()) and all(c[0] == "reusable" for c in p.calls[1:])
    with pytest.raises(ValueError, match="naive arm takes none"):
        run_pass(Recorded(prof, set()), given, naive=True)
    with pytest.raises(ValueError, match="one bool per relocated row"):
        run_pass(Recorded(prof, set()), given[:-1])


def llama():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, eos_token_ids=(1,))
    torch.manual_seed(0)
    m = Llama(cfg).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


@pytest.mark.parametrize("family", ["deepseek_v4", "llama"])
def test_one_engine_class_serves_both_families_with_the_same_rule(family):
    """The same engine class, profile rule and result type on both families: the rule's budget of relocated rows is
    active, recorded in the result, and forcing exactly those rows gives the same logits."""
    g = torch.Generator().manual_seed(5)
    if family == "llama":
        m = llama()
        prof = ReuseProfile(first_fences=1, last_fences=1, align=1, budget=0.25, recent_rows=2, join_rows=2)
        make = produce_llama
    else:
        m = tiny_model()
        prof = ReuseProfile(first_fences=2, last_fences=2, align=16, budget=0.25, recent_rows=16, join_rows=8)
        make = produce
    lens = (32, 48, 32)
    docs = [make(m, torch.randint(2, m.cfg.vocab_size, (n,), generator=g).tolist(), prof) for n in lens]
    question = torch.randint(2, m.cfg.vocab_size, (6,), generator=g).tolist()
    eng = ReuseEngine(m, prof)
    assert eng.adapter.family == family
    res = eng.prefill(docs, question)
    assert isinstance(res, ReuseResult) and res.logits.shape == (m.cfg.vocab_size,)
    n_reloc = sum(lens[1:])
    assert res.active_rows.numel() == -(-n_reloc // 4)
    mask = torch.zeros(n_reloc, dtype=torch.bool)
    mask[res.active_rows - lens[0]] = True
    assert torch.equal(eng.prefill(docs, question, active=mask).logits, res.logits)
    ids, again = eng.generate(docs, question, 3, stop=set())
    assert len(ids) == 3 and torch.equal(again.logits, res.logits)


def test_paths_a_family_lacks_are_refused_clearly():
    m = tiny_model()
    prof = ReuseProfile(first_fences=2, last_fences=2, align=16)
    with pytest.raises(ValueError, match="reuse arm only"):
        ReuseEngine(m, prof, mode="naive")
    with pytest.raises(ValueError, match="never rewritten or concatenated"):
        ReuseEngine(m, prof).prefill_cache([], [1])
    with pytest.raises(ValueError, match="not in"):
        ReuseEngine(m, prof, mode="cached")
    with pytest.raises(TypeError, match="no reuse adapter for a Linear"):
        ReuseEngine(torch.nn.Linear(2, 2), prof)
