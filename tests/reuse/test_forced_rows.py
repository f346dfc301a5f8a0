"""`ReuseEngine.prefill(..., active=mask)`: the caller's active rows instead of the controller's (how tests and
benchmarks compare two paths on the same rows, without patching the engine). The controller's own choice handed
back gives the same result bit for bit; another choice is really taken; a mask that is not one bool per relocated
row is refused."""
import pytest
import torch

from runtime.model.config import tiny_reuse
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.producer import produce
from runtime.reuse.profile import ReuseProfile
from tests.tiny import tiny_model

CFG = tiny_reuse()
PROF = ReuseProfile(first_fences=2, last_fences=2, align=16, budget=0.25, recent_rows=16, join_rows=8)


def test_forced_active_rows_are_the_rows_taken():
    model = tiny_model(CFG, seed=1)
    model.eval()
    g = torch.Generator().manual_seed(5)
    arts = [produce(model, torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist(), PROF) for n in (48, 64, 32)]
    question = torch.randint(2, CFG.vocab_size, (8,), generator=g).tolist()
    eng = ReuseEngine(model, PROF)
    ref = eng.prefill(arts, question)
    n_reloc = sum(a.n for a in arts[1:])
    mask = torch.zeros(n_reloc, dtype=torch.bool)
    mask[ref.active_rows - arts[0].n] = True
    same = eng.prefill(arts, question, active=mask)
    assert torch.equal(same.logits, ref.logits) and torch.equal(same.active_rows, ref.active_rows)
    assert same.ledger.reuse_flops == ref.ledger.reuse_flops
    other = mask.roll(7)
    assert not torch.equal(other, mask)
    got = eng.prefill(arts, question, active=other)
    assert torch.equal(got.active_rows, torch.nonzero(other).flatten() + arts[0].n)
    assert not torch.equal(got.logits, ref.logits)
    for bad in (mask[:-1], mask.float()):
        with pytest.raises(ValueError, match="bool mask"):
            eng.prefill(arts, question, active=bad)
