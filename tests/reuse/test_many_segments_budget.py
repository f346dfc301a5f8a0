"""test_many_segments.py's budget case, in a file of its own so that pytest-xdist (--dist loadfile keeps a file on one
worker) runs it beside that file's 64-document exactness case instead of after it: at 64 documents under a real
budget the reuse arm really reuses (the same test, the same model fixture)."""
import torch

from runtime.reuse.engine import ReuseEngine
from runtime.reuse.producer import produce
from runtime.reuse.profile import ReuseProfile

from .test_many_segments import model, uneven  # noqa: F401
from .test_reuse_exactness import BASE, rel_err


def test_sixty_four_segments_under_a_budget_reuse_and_stay_close(model):  # noqa: F811
    """Not exact (non-active rows keep their document-local state): the arm restored rows and skipped heads, and
    its logits stay within the distance the naive arm (no row recomputed) does not."""
    docs, question = uneven(64, seed=7)
    prof = ReuseProfile(**BASE, budget=0.25)
    arts = [produce(model, t, prof) for t in docs]
    ref = model(torch.tensor([t for a in arts for t in a.tokens] + question))
    res = ReuseEngine(model, prof).prefill(arts, question)
    led = res.ledger.summary()
    assert 0 < led["rows"]["active"] < led["rows"]["relocated"] and led["head_row_saving"] > 0, led
    err = rel_err(res.logits, ref)
    assert 0 < err < 1.0, err
