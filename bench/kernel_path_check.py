"""Where do the kernel path and the torch reference path of the reuse arm part? Runs the reuse arm twice on the
same model, artifacts and active rows (REDKNOT_KERNELS=1, then 0) and prints, layer by layer, the relative
difference of the residual stream after each layer, and of the first-token logits. In float32 the kernels
multiply in full float32, so every layer should agree to rounding (~1e-6); a jump at one layer names the layer
kind whose kernel plumbing differs. Not a test (tests/kernels/test_reuse_gpu.py is).

    python bench/kernel_path_check.py [--dtype float32|bfloat16] [--budget 0.25]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.model.checkpoint import random_state  # noqa: E402
from runtime.model.config import tiny_reuse  # noqa: E402
from runtime.model.deepseek_v4 import Transformer  # noqa: E402
from runtime.reuse.engine import ReuseEngine  # noqa: E402
from runtime.reuse.producer import produce  # noqa: E402
from runtime.reuse.profile import ReuseProfile  # noqa: E402

CFG = tiny_reuse()


def run(model, arts, question, prof, force):
    """The reuse prefill with every layer's output traced; `force`: the active rows (None: the profile's rule).
    Returns the result, the trace and the active rows as a mask over the relocated rows."""
    eng = ReuseEngine(model, prof)
    trace = {}
    own_layer = eng.adapter._reusable_layer

    def layer(call, i, *a, **kw):
        out = own_layer(call, i, *a, **kw)
        trace[i] = out.float().cpu().clone()
        return out
    hooks = [b.register_forward_hook(lambda mod, inp, out, i=i: trace.__setitem__(i, out.float().cpu().clone()))
             for i, b in enumerate(model.layers)]
    eng.adapter._reusable_layer = layer
    try:
        res = eng.prefill(arts, question, active=force)
    finally:
        for h in hooks:
            h.remove()
    active = torch.zeros(sum(a.n for a in arts[1:]), dtype=torch.bool)
    active[(res.active_rows - arts[0].n).cpu()] = True
    return res, trace, active


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = Transformer(CFG, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                           for k, v in random_state(CFG, seed=1).items()})
    model.eval()
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist() for n in (300, 520, 260)]
    question = torch.randint(2, CFG.vocab_size, (24,), generator=g).tolist()
    prof = ReuseProfile(first_fences=2, last_fences=2, align=16, budget=args.budget, recent_rows=16, join_rows=8)
    with torch.no_grad():
        os.environ["REDKNOT_KERNELS"] = "0"
        arts = [produce(model, d, prof) for d in docs]
        ref, tr_ref, active = run(model, arts, question, prof, None)
        os.environ["REDKNOT_KERNELS"] = "1"
        got, tr_got, _ = run(model, arts, question, prof, active)
    print(f"# {args.dtype}, budget {args.budget:.0%}, {int(active.sum())} active rows; same artifacts and rows")
    for i in sorted(tr_ref):
        a, b = tr_got[i], tr_ref[i]
        n = min(a.shape[0], b.shape[0])
        err = ((a[-n:] - b[-n:]).abs().max() / b[-n:].abs().max()).item()
        kind = {0: "window"}.get(CFG.compress_ratios[i], f"ratio {CFG.compress_ratios[i]}")
        role = "fence" if prof.is_fence(CFG, i) else "reusable"
        print(f"layer {i} ({kind}, {role}): residual stream rel diff {err:.2e}  rows {tuple(a.shape)}")
    err = ((got.logits - ref.logits).abs().max() / ref.logits.abs().max()).item()
    print(f"first-token logits rel diff {err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
