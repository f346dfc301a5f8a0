"""The consumer's host count of (query, key) pairs is made once per call's rows and segment shapes (`trig`), and
equals the count made afresh for every shape it is asked."""
from types import SimpleNamespace

import numpy as np
import torch

from runtime.reuse.keys import SegmentKeys
from runtime.reuse.segments import _count_pairs, _pairs_host


def _segs(ns, deltas, n_entries):
    return [SegmentKeys(d, torch.zeros(n, 4), None if e is None else torch.zeros(e, 4))
            for n, d, e in zip(ns, deltas, n_entries)]


def test_pairs_are_counted_once_per_rows_and_shapes_and_equal_a_fresh_count(monkeypatch):
    attn = SimpleNamespace(cfg=SimpleNamespace(window_size=8), ratio=4)
    host = np.sort(np.random.default_rng(0).choice(300, 120, replace=False))
    trig = {}
    a = _segs([100, 90, 110], [0, 100, 190], [25, 22, 27])
    b = _segs([100, 90, 110], [0, 100, 190], [25, 20, 27])          # one segment's entries differ
    for causal in (True, False):
        for segs in (a, b):
            want = _count_pairs(attn, host, segs, causal)
            assert want > 0 and _pairs_host(attn, host, segs, causal, trig) == want
            assert _pairs_host(attn, host, segs, causal, None) == want
    # the window-only count does not depend on the entries: a and b share one memo entry there
    assert len(trig) == 3 and _count_pairs(attn, host, a, True) != _count_pairs(attn, host, b, True)
    calls = []
    import runtime.reuse.segments as c
    monkeypatch.setattr(c, "_count_pairs", lambda *args: calls.append(1) or _count_pairs(*args))
    for _ in range(5):                                               # every later layer of the kind: no recount
        assert _pairs_host(attn, host, a, True, trig) == _count_pairs(attn, host, a, True)
    assert calls == []
