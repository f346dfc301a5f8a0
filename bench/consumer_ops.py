"""Launch and host-sync counts of the reuse arm's reusable layers, measured on CPU (torch.profiler) at real head
counts (64 heads of 512, 8 output groups, window 128) with a small model width, a few layers and a few thousand
tokens. The consumer takes its GPU code path: `enabled()` is forced on and each GPU kernel is replaced by its
torch reference wrapped as counted launches: sparse attention, RoPE slice, stacked merge, the fused
multi-segment kernel, mHC pre/post; `Rotary.apply` as its copy and its RoPE kernel; the model's RMS norm and
indexer scores; the multi-segment indexer scores with their table's copy; the compressor's float32 projections
as their GEMM and two adds; the grouped MoE's GEMMs. Every other top-level aten op inside a reusable layer counts
as one launch, every `_local_scalar_dense` / `nonzero` outside a kernel's stand-in as a host sync. The documents
are laid out as LayerPrefetcher stages pinned ones (`owned_copies`: each layer of all documents in one buffer).
Not a test.

    python bench/consumer_ops.py --tokens 2048 --layers 8 [--by-phase] [--layer 4]

`--layer N` gives reusable layer N's phases (0 = the first, which also builds the request's caches) instead of
the average; `--by-phase` each phase's ops.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.ttft import request  # noqa: E402
from runtime.model.random_init import init_random  # noqa: E402
from runtime.model.config import FLASH  # noqa: E402
from runtime.model.deepseek_v4 import Transformer  # noqa: E402
from runtime.reuse.engine import ReuseEngine  # noqa: E402
from runtime.reuse.packing import owned_copies  # noqa: E402
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
    import runtime.reuse.deepseek as deepseek
    import runtime.reuse.picks as picks_mod
    import runtime.reuse.segments as consumer
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
            total = pick_first[-1] + (0 if last is None else last.shape[0])
            per_seg = picks_mod.split_picks(picks, pick_first, total)
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
        consumer.rope_ = picks_mod.rope_ = one("rope", rope_reference_)
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
    # the model's own CUDA kernels, which its CPU path runs op by op (the CPU model here is float32, so their
    # `supported` checks would refuse): RMS norm one launch; the indexer's scores its weight scaling and one
    # launch; the compressor's float32 projections (runtime/kernels/f32linear.py, under ROWS rows) one GEMM and
    # two adds for all weights; MoE's routed experts the grouped form (torch._grouped_mm, which runs on CPU too)
    from runtime.model.deepseek_v4 import MoE, RMSNorm, Compressor, Indexer, weighted_rms_norm
    if not getattr(RMSNorm, "_counted", False):
        RMSNorm.forward = one("rms_norm", lambda self, x: weighted_rms_norm(x, self.weight, self.eps))
        score = Indexer.scores_roped

        def scores_roped(self, q, w_raw, positions, keys, out=None, w=None):
            if w is None:
                w = self.head_weights(q, w_raw)                          # the kernel path's weight scaling
            with torch.profiler.record_function("kernel::indexer_scores"):
                return score(self, q, None, positions, keys, out=out, w=w)
        Indexer.scores_roped = scores_roped
        project = Compressor.project

        def project_counted(self, x):
            for _ in range(2):
                with torch.profiler.record_function("kernel::f32linear_add"):
                    pass
            with torch.profiler.record_function("kernel::f32linear_mm"):      # its torch ops are inside: not counted
                return project(self, x)
        Compressor.project = project_counted
        MoE.grouped_ok = lambda self, x: True
        torch._grouped_mm = one("grouped_mm", torch._grouped_mm)    # its CPU fallback's host reads are not CUDA's
        RMSNorm._counted = True
    layer = deepseek.DeepSeekAdapter._reusable_layer

    def counted(self, *a, **kw):
        with torch.profiler.record_function("reusable_layer"):
            return layer(self, *a, **kw)
    deepseek.DeepSeekAdapter._reusable_layer = counted


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--top", type=int, default=16, help="ops shown")
    ap.add_argument("--by-phase", action="store_true", help="also each phase label's ops")
    ap.add_argument("--layer", type=int, default=None,
                    help="the phase counts of this reusable layer (0 = the first) instead of the average")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = FLASH.replace(dim=512, q_lora_rank=256, o_lora_rank=256, index_n_heads=8, index_head_dim=64,
                        index_topk=128, n_routed_experts=8, moe_inter_dim=128, vocab_size=1024, n_hash_layers=1,
                        n_layers=args.layers, compress_ratios=FLASH.compress_ratios[:args.layers])
    prof = FLASH_PROFILE.replace(first_fences=2, last_fences=1, global_picks="artifact")
    model = Transformer(cfg, dtype=torch.float32)
    init_random(model, 0, per_name=False)
    model.eval()
    docs, question = request(cfg, args.tokens, args.docs, args.question, seed=1)
    arts = [produce(model, d, prof) for d in docs]
    eng = ReuseEngine(model, prof)
    _gpu_path()
    arts = owned_copies(arts)    # one buffer a layer, overlaid in place: as LayerPrefetcher stages pinned documents
    for blk in model.layers:                 # the grouped MoE's weight stacks, built in the warm-up on CUDA
        if hasattr(blk.ffn, "stacks"):
            blk.ffn.stacks()
    from torch.profiler import ProfilerActivity, profile
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        res = eng.prefill(arts, question)
    wall = time.perf_counter() - t
    counts, syncs, per_layer, per_op = Counter(), Counter(), Counter(), Counter()
    for ev in p.events():
        if not (ev.name.startswith("aten::") or ev.name.startswith("kernel::")):
            continue
        up, top, label, in_kernel = ev.cpu_parent, True, None, False
        while up is not None and up.name != "reusable_layer":
            top = top and not ((up.name.startswith("aten::") and up.name not in NO_LAUNCH)
                               or up.name.startswith("kernel::"))
            in_kernel = in_kernel or up.name.startswith("kernel::")
            if label is None and up.name.startswith("rk."):
                label = up.name                                  # the innermost phase label
            up = up.cpu_parent
        if up is None:
            continue
        if ev.name in SYNCS and not in_kernel:                   # at any depth outside a kernel's stand-in
            syncs[ev.name] += 1
        if top and ev.name not in NO_LAUNCH:                     # a launch of a reusable layer
            counts[ev.name] += 1
            per_layer[up.time_range.start] += 1
            per_op[(up.time_range.start, label or "(no label)", ev.name)] += 1
    launches, n_sync = sum(counts.values()), sum(syncs.values())
    led = res.ledger.summary()
    print(f"# {cfg.n_layers} layers ({len(prof.reusable_layers(cfg))} reusable), {cfg.n_heads} heads x "
          f"{cfg.head_dim}, {sum(len(d) for d in docs) + len(question)} tokens, active "
          f"{led['rows']['active']}/{led['rows']['relocated']}; profiled prefill {wall:.2f} s on CPU")
    n_r = len(prof.reusable_layers(cfg))
    print(f"reusable layers: {launches} launches ({launches / n_r:.0f} per layer), {n_sync} host syncs "
          f"({n_sync / n_r:.0f} per layer: {dict(syncs)})")
    print("  each reusable layer in order (the first builds the request's angle caches):",
          [per_layer[k] for k in sorted(per_layer)])
    for k, v in counts.most_common(args.top):
        print(f"  {k:28s} {v:6d}")
    starts = sorted(per_layer)
    pick, div = (None, n_r) if args.layer is None else (starts[args.layer], 1)
    phases, phase_ops = Counter(), Counter()
    for (st, ph, op), c in per_op.items():
        if pick is None or st == pick:
            phases[ph] += c
            phase_ops[(ph, op)] += c
    print("per reusable layer" if pick is None else f"reusable layer {args.layer}",
          "by innermost phase label (runtime/reuse/deepseek.py):")
    for k, v in phases.most_common():
        print(f"  {k:28s} {v / div:6.0f}")
        if args.by_phase:
            for (ph, op), c in sorted(phase_ops.items(), key=lambda kv: -kv[1]):
                if ph == k:
                    print(f"      {op:28s} {c / div:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
