"""Issue 34's bound, end to end: a reusable layer's work is a fixed list of launches whatever the number of documents.
A reuse prefill through the kernels (Triton's interpreter, the test model; the active rows' calls on the fused
kernel, the Global heads' on the stacked parts, CSA picks by the online indexer over the union of segments) is
run over 2 and over 5 documents after a warm-up request; in every reusable layer the Triton launches and the torch
operations that would launch on a GPU (`DeviceOps`) are the same lists, the FFN left out (the routed MoE launches
per expert that some row picked: it varies with the rows, not with the documents). (A file of its own so that
`make test` runs it on another process.)"""
import collections

import pytest
import torch

import runtime.reuse.deepseek as ds
from runtime.policy import RuntimePolicy
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.packing import owned_copies
from runtime.reuse.producer import produce
from runtime.reuse.profile import ReuseProfile

from .test_interpret import CFG, DeviceOps, kernels_on, model, pytestmark  # noqa: F401


@torch.no_grad()
def test_reusable_layers_launch_the_same_whatever_the_documents(model, kernels_on, monkeypatch):  # noqa: F811
    from triton.runtime.interpreter import InterpretedFunction
    per_layer, cur = collections.defaultdict(collections.Counter), {"layer": None, "ffn": False}
    real_run = InterpretedFunction.run

    def run(self, *a, **kw):
        if cur["layer"] is not None and not cur["ffn"]:
            per_layer[cur["layer"]][self.fn.__name__] += 1
        return real_run(self, *a, **kw)
    monkeypatch.setattr(InterpretedFunction, "run", run)
    real_layer = ds.DeepSeekAdapter._reusable_layer

    def layer(self, call, i, *a, **kw):
        cur["layer"] = i
        try:
            with DeviceOps(skip=lambda: cur["ffn"]) as ops:
                return real_layer(self, call, i, *a, **kw)
        finally:
            per_layer[i].update(ops.counts)
            cur["layer"] = None
    monkeypatch.setattr(ds.DeepSeekAdapter, "_reusable_layer", layer)
    for name in ("_ffn", "_active_ffn"):
        def ffn(self, *a, real=getattr(ds.DeepSeekAdapter, name), **kw):
            cur["ffn"] = True
            try:
                return real(self, *a, **kw)
            finally:
                cur["ffn"] = False
        monkeypatch.setattr(ds.DeepSeekAdapter, name, ffn)
    prof = ReuseProfile(first_fences=2, last_fences=2, align=16, budget=0.25, global_picks="online")
    g = torch.Generator().manual_seed(7)
    got = {}
    with model.policy_as(RuntimePolicy(fused_min_heads=CFG.n_heads)):    # 8 heads fused, the Global heads stacked
        for label, n_docs in (("warm-up", 2), (2, 2), (5, 5)):
            docs = [torch.randint(2, CFG.vocab_size, (32,), generator=g).tolist() for _ in range(n_docs)]
            monkeypatch.setenv("REDKNOT_KERNELS", "0")
            arts = [produce(model, d, prof) for d in docs]
            monkeypatch.setenv("REDKNOT_KERNELS", "1")
            per_layer.clear()
            res = ReuseEngine(model, prof).prefill(owned_copies(arts), [5, 6, 7, 8])
            assert res.active_rows.numel() > 0
            got[label] = {i: dict(c) for i, c in per_layer.items()}
    assert sorted(got[2]) == sorted(got[5]) and len(got[2]) >= 4
    for i in got[2]:
        assert got[2][i] == got[5][i], (i, {k: (got[2][i].get(k), got[5][i].get(k)) for k in
                                            set(got[2][i]) | set(got[5][i]) if got[2][i].get(k) != got[5][i].get(k)})
    kernels = {k for c in got[5].values() for k in c if k.startswith("_")}
    assert {"_indexer_parts_kernel", "_sparse_mqa_kernel"} <= kernels, kernels     # the union's picks, stacked
