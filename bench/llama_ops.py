"""Torch ops (each a kernel launch on CUDA, views and metadata excluded) and host syncs per arm of `redknot eval`
for one real question with the real SmolLM2-135M (the cached GGUF conversion), on CPU. The harness runs
unchanged under a counting TorchDispatchMode; each op is charged to the arm whose code is on the stack (the
harness's own phases are wrapped by name; what no wrapper claims is `other`). A host sync is an op whose result
the host must read: `_local_scalar_dense` (.item(), int(), bool()), `nonzero`, boolean-mask indexing and
index_put_, a copy to the CPU. Not a test.

    python bench/llama_ops.py --task hotpotqa --index 0 --max-new-tokens 16
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections import Counter, defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = "reuse@0.25:lastkv=artifact,reuse@0.25:lastkv=artifact:select=deviation:signal=kv"
# ops that launch no kernel on CUDA (views, metadata, allocation)
NO_LAUNCH = {"slice", "view", "select", "reshape", "expand", "unsqueeze", "squeeze", "as_strided", "alias", "t",
             "transpose", "permute", "detach", "empty", "empty_like", "empty_strided", "_unsafe_view", "lift_fresh",
             "unbind", "split", "split_with_sizes", "_reshape_alias", "new_empty", "new_empty_strided", "set_",
             "is_same_size", "diagonal", "unfold", "view_as", "chunk", "narrow", "movedim"}


def _name(func) -> str:
    return func._schema.name.removeprefix("aten::")


def _bool_index(args) -> bool:
    idx = args[1] if len(args) > 1 else None
    return isinstance(idx, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx)


class Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.label = ["other"]
        self.ops = defaultdict(Counter)
        self.syncs = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:                           # linear, einsum, to, ...: count what they decompose into
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        n = _name(func)
        lab = self.label[-1]
        if n not in NO_LAUNCH:
            self.ops[lab][n] += 1
        if n in ("_local_scalar_dense", "nonzero", "masked_select") or (n in ("index", "index_put_", "index_put")
                                                                         and _bool_index(args)):
            self.syncs[lab][n] += 1
        return func(*args, **kwargs)


def wrap(mode: Counting, owner, attr: str, label):
    fn = getattr(owner, attr)

    def wrapped(*a, **kw):
        mode.label.append(label(*a, **kw) if callable(label) else label)
        try:
            return fn(*a, **kw)
        finally:
            mode.label.pop()
    setattr(owner, attr, wrapped)


# harness functions -> the phase their ops are charged to
PHASES = {"_greedy": "recompute", "_prefix_only": "prefix-only", "produce_llama": "artifacts",
          "_recompute_prefill": "recompute", "_prefix_only_prefill": "prefix-only",
          "produce_llama_many": "artifacts",
          "produce_llama_packed": "artifacts", "relocate": "relocation (shared)"}


def engine_label(eng, *a, **kw) -> str:
    """The arm's canonical name (`runtime.eval.arms`, which leaves out knobs at the eval's defaults) from the
    engine's profile, so the counts line up with the harness's arms."""
    if eng.mode == "naive":
        return "naive"
    from runtime.eval.arms import parse_arm
    p = eng.prof
    return parse_arm(f"reuse@{p.budget}:fences={p.first_fences}+{p.last_fences}:gpg={p.global_per_group}"
                     f":ffn={p.ffn_mode}:lastkv={p.last_fence_kv}:select={p.select}:signal={p.signal}"
                     f":join={p.join_rows}:recent={p.recent_rows}").name


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="hotpotqa")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--budgets", default="0.1,0.2,0.25")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--top", type=int, default=0, help="also print each arm's most frequent ops")
    ap.add_argument("--reference", action="store_true", help="the harness's reference path (each arm alone)")
    ap.add_argument("--cpu-path", action="store_true", help="the engine's CPU path (attention split by heads); "
                                                            "default: the path it takes on CUDA")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    import runtime.eval.harness as harness
    from runtime.eval.data import load_task
    from runtime.llama.gguf import convert_gguf
    from runtime.llama.loader import load_llama
    from runtime.llama.model import Llama
    from runtime.llama.tokenizer import ChatTokenizer
    from runtime.reuse.engine import ReuseEngine

    d = convert_gguf().out
    model, tok = load_llama(d), ChatTokenizer.from_dir(d)
    ex = next(itertools.islice(load_task(args.task), args.index, None))
    lay = harness.layout(tok, ex)
    n_tok = sum(map(len, lay.segments)) + len(lay.question)
    mode = Counting()
    for name, label in PHASES.items():
        if hasattr(harness, name):
            wrap(mode, harness, name, label)
    init = ReuseEngine.__init__

    def init_path(self, *a, **kw):                  # count the path the engine takes on CUDA unless --cpu-path
        init(self, *a, **kw)
        self.adapter.split_heads = args.cpu_path
    ReuseEngine.__init__ = init_path
    wrap(mode, ReuseEngine, "generate", engine_label)
    wrap(mode, ReuseEngine, "prefill_cache", engine_label)
    wrap(mode, Llama, "greedy_many", "decode (all arms, batched)")
    import runtime.reuse.controller as engine                   # the fast path runs the controller on host tensors
    for f in ("choose_active", "choose_by_deviation", "choose_top"):
        wrap(mode, engine, f, "controller (host tensors)")
    budgets = [float(b) for b in args.budgets.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    t = time.perf_counter()
    with torch.backends.mkldnn.flags(enabled=False), mode:
        s = harness.run_eval(model, tok, [ex], budgets, args.max_new_tokens, variants=variants,
                             reference=args.reference)
    wall = time.perf_counter() - t
    print(f"# {args.task}[{args.index}]: {len(lay.segments)} segments, {n_tok} tokens, max-new-tokens "
          f"{args.max_new_tokens}; {wall:.1f} s on CPU under the counter")
    print(f"{'phase':44s} {'ops':>8s} {'syncs':>7s}  answer")
    tot_o = tot_s = 0
    for lab in sorted(mode.ops, key=lambda k: (k not in s["arms"], list(s["arms"]).index(k) if k in s["arms"]
                                               else 0, k)):
        o, y = sum(mode.ops[lab].values()), sum(mode.syncs[lab].values())
        tot_o, tot_s = tot_o + o, tot_s + y
        ans = s["raw"][lab]["answers"][0] if lab in s["raw"] else ""
        print(f"{lab:44s} {o:8d} {y:7d}  {ans!r}")
        for k, v in mode.ops[lab].most_common(args.top):
            print(f"    {k:30s} {v:7d}")
    print(f"{'total':44s} {tot_o:8d} {tot_s:7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
