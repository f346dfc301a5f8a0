"""Launch and host-sync counts of the reuse arm's reusable layers, measured on CPU (torch.profiler) at real head
counts (64 heads of 512, 8 output groups, window 128) with a small model width, a few layers and a few thousand
tokens. The consumer takes its GPU code path: `enabled()` is forced on and each GPU kernel (sparse attention, RoPE
slice, stacked merge, the fused multi-segment kernel, mHC pre/post; `Rotary.apply` as its copy and its RoPE kernel)
is replaced by its torch reference wrapped as ONE counted launch; every other top-level aten
op inside a reusable layer counts as one launch, every `_local_scalar_dense` / `nonzero` as a host sync.
Not a test.

    python bench/consumer_ops.py --tokens 2048 --layers 6
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.ttft import init_model, request  # noqa: E402
from runtime.model.config import FLASH  # noqa: E402
from runtime.model.deepseek_v4 import Transformer  # noqa: E402
from runtime.reuse.consumer import ReuseEngine  # noqa: E402
from runtime.reuse.prefetch import owned_copy  # noqa: E402
from runtime.reuse.producer import produce  # noqa: E402
from runtime.reuse.profile import FLASH_PROFILE  # noqa: E402

# ops that launch no kernel on CUDA (views, metadata, allocation)
NO_LAUNCH = {f"aten::{n}" for n in (
    "slice", "view", "select", "reshape", "expand", "expand_as", "unsqueeze", "squeeze", "as_strided", "alias", "t",
    "transpose", "permute", "flatten", "unflatten", "narrow", "split", "chunk", "detach", "empty", "empty_like",
    "empty_strided", "_unsafe_view", "lift_fresh", "result_type", "resolve_conj", "resolve_neg", "unbind", "numpy_T",
    "contiguous", "_reshape_alias", "view_as", "broadcast_tensors", "item", "is_nonzero", "size", "stride", "dim",
    "to", "type_as", "matmul", "linear", "einsum", "_local_scalar_dense", "is_same_size", "movedim", "diagonal", "split_with_sizes", "set_", "new_empty", "new_empty_strided")}
# "to", "matmul", "linear", "einsum" are transparent: the op they dispatch to (_to_copy, mm, bmm) is counted
NO_LAUNCH -= {"aten::_to_copy"}
SYNCS = {"aten::_local_scalar_dense", "aten::nonzero"}


def _gpu_path() -> None:
    """Route the consumer through its GPU code path with each kernel counted as one launch."""
    import runtime.reuse.consumer as consumer
    from runtime.kernels.reference import sparse_mqa_reference

    def one(name, fn):
        def wrapped(*a, **kw):
            with torch.profiler.record_function(f"kernel::{name}"):
                return fn(*a, **kw)
        return wrapped

    def sparse(q, keys, cpos, window, entries=None, mode="none", ratio=1, picks=None, scale=None, out=None):
        o, lse = sparse_mqa_reference(q, keys, cpos, window, entries, mode, ratio, picks, scale)
        if out is None:
            return o, lse
        out[0].copy_(o)
        out[1].copy_(lse)
        return out

    def multiseg(q_raw, qpos, segments, sink, window, mode, ratio, scale, inv_freq, picks=None, pick_first=None,
                 bounds=None, **kw):
        """The fused multi-segment kernel's output by the reference path: its global picks split per segment."""
        import types
        from runtime.model.config import CSA, HCA, WINDOW
        from runtime.model.deepseek_v4 import Rotary
        attn = types.SimpleNamespace(kind={"none": WINDOW, "causal": HCA, "picks": CSA}[mode], ratio=ratio,
                                     scale=scale, rotary=Rotary(inv_freq), indexer=None,
                                     cfg=types.SimpleNamespace(window_size=window))
        per_seg = None
        if mode == "picks":
            last = segments[-1].entries
            per_seg = consumer.split_picks(picks, pick_first, pick_first[-1] + (0 if last is None else last.shape[0]))
        consumer.enabled = lambda t: False
        try:
            return consumer.segment_attention(attn, q_raw, qpos, segments, sink, picks=per_seg,
                                              qpos_host=qpos.cpu().numpy())[0]
        finally:
            consumer.enabled = lambda t: True
    consumer.enabled = lambda t: True
    consumer.sparse_mqa_attention = one("sparse_mqa", sparse)
    consumer.multi_segment_attention = one("multiseg", multiseg)
    if hasattr(consumer, "rope_"):
        from runtime.kernels.merge import merge_stacked_reference
        from runtime.kernels.rope import rope_reference_
        consumer.rope_ = one("rope", rope_reference_)
        def merge(o, lse, sink, out_dtype, ranges=None, out=None):
            got = merge_stacked_reference(o, lse, sink, out_dtype, ranges)
            return got if out is None else out.copy_(got)
        consumer.merge_stacked = one("merge", merge)
    # mHC: on CUDA `Block.hc_pre` is two launches (runtime/kernels/mhc.py) and `hc_post` one; counted as one each
    from runtime.model.deepseek_v4 import Block, Rotary
    if not getattr(Block, "_counted", False):
        Block.hc_pre = one("hc_pre", Block.hc_pre)
        Block.hc_post = staticmethod(one("hc_post", Block.hc_post))
        Block._counted = True
    # Rotary.apply: on CUDA two launches (the other channels copied, then runtime/kernels/rope.py)
    if not getattr(Rotary, "_counted", False):
        rotate = Rotary.apply

        def apply(x, cos, sin, inverse=False):
            with torch.profiler.record_function("kernel::rope_copy"):
                pass
            with torch.profiler.record_function("kernel::rope"):
                return rotate(x, cos, sin, inverse)
        Rotary.apply = staticmethod(apply)
        Rotary._counted = True
    layer = consumer.ReuseEngine._reusable_layer

    def counted(self, *a, **kw):
        with torch.profiler.record_function("reusable_layer"):
            return layer(self, *a, **kw)
    consumer.ReuseEngine._reusable_layer = counted


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--top", type=int, default=16, help="ops shown")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = FLASH.replace(dim=512, q_lora_rank=256, o_lora_rank=256, index_n_heads=8, index_head_dim=64,
                        index_topk=128, n_routed_experts=8, moe_inter_dim=128, vocab_size=1024, n_hash_layers=1,
                        n_layers=args.layers, compress_ratios=FLASH.compress_ratios[:args.layers])
    prof = FLASH_PROFILE.replace(first_fences=2, last_fences=1, global_picks="artifact")
    model = Transformer(cfg, dtype=torch.float32)
    init_model(model, 0)
    model.eval()
    docs, question = request(cfg, args.tokens, args.docs, args.question, seed=1)
    arts = [produce(model, d, prof) for d in docs]
    eng = ReuseEngine(model, prof)
    _gpu_path()
    arts = [owned_copy(a) for a in arts]     # overlaid in place, as LayerPrefetcher's copies on CUDA
    from torch.profiler import ProfilerActivity, profile
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        res = eng.prefill(arts, question)
    wall = time.perf_counter() - t
    counts, syncs, phases = Counter(), Counter(), Counter()
    for ev in p.events():
        if not (ev.name.startswith("aten::") or ev.name.startswith("kernel::")):
            continue
        up, top, label = ev.cpu_parent, True, None
        while up is not None and up.name != "reusable_layer":
            top = top and not ((up.name.startswith("aten::") and up.name not in NO_LAUNCH)
                               or up.name.startswith("kernel::"))
            if label is None and up.name.startswith("rk."):
                label = up.name                                  # the innermost phase label
            up = up.cpu_parent
        if up is None:
            continue
        if ev.name in SYNCS:                                     # at any depth
            syncs[ev.name] += 1
        if top and ev.name not in NO_LAUNCH:                     # a launch of a reusable layer
            counts[ev.name] += 1
            phases[label or "(no label)"] += 1
    launches, n_sync = sum(counts.values()), sum(syncs.values())
    led = res.ledger.summary()
    print(f"# {cfg.n_layers} layers ({len(prof.reusable_layers(cfg))} reusable), {cfg.n_heads} heads x "
          f"{cfg.head_dim}, {sum(len(d) for d in docs) + len(question)} tokens, active "
          f"{led['rows']['active']}/{led['rows']['relocated']}; profiled prefill {wall:.2f} s on CPU")
    n_r = len(prof.reusable_layers(cfg))
    print(f"reusable layers: {launches} launches ({launches / n_r:.0f} per layer), {n_sync} host syncs "
          f"({n_sync / n_r:.0f} per layer: {dict(syncs)})")
    for k, v in counts.most_common(args.top):
        print(f"  {k:28s} {v:6d}")
    print("per reusable layer, by innermost phase label (runtime/reuse/consumer.py):")
    for k, v in phases.most_common():
        print(f"  {k:28s} {v / n_r:6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
