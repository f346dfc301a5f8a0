"""Routed-MoE benchmark: the model's two forms of `MoE.routed`, `routed_loop` (one stable sort, one host read of
the per-expert counts, then a gather + three GEMMs + scatter-add per expert; the CPU reference) and `routed_grouped`
(one `torch._grouped_mm` per weight over the experts' stacked weights, no host read; what CUDA runs for calls of up
to `MoE.grouped_slots()` slots), on the same rows and routing.

    python3 bench/moe.py [--rows 5734,11469,65600] [--experts 16] [--fanout native|adaptive] [--json out.json]

Per row count, at Flash's dims (dim 4096, expert inner dim 2048, top-6 of --experts routed experts, bf16): CUDA time
(events, median of --reps after a warm-up), host time to issue each (wall clock until the last launch returns, no
synchronize), and the relative difference of the outputs. `--fanout adaptive` drops slots through the consumer's
`adaptive_fanout` at the profile defaults (smallest k >= 3 reaching tau = 0.9 of the top-6 weight; dropped slots
are -1 and run no expert), the active rows' case; `native` keeps all six, the recompute arm's case. `--small` runs
tiny dims on CPU (a smoke run, not a measurement).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.model.config import FLASH  # noqa: E402
from runtime.model.deepseek_v4 import MoE, Parallel  # noqa: E402
from runtime.reuse.fanout import adaptive_fanout  # noqa: E402
from runtime.reuse.profile import ReuseProfile  # noqa: E402
from bench.report import header, write_json  # noqa: E402


def timed(fn, reps: int, cuda: bool):
    fn()
    dev_t, host_t = [], []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t = time.perf_counter()
        fn()
        host_t.append(time.perf_counter() - t)
        if cuda:
            b.record()
            torch.cuda.synchronize()
            dev_t.append(a.elapsed_time(b) / 1000)
        else:
            dev_t.append(host_t[-1])
    return statistics.median(dev_t), statistics.median(host_t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="5734,11469,65600")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--fanout", default="adaptive", choices=["native", "adaptive"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [int(v) for v in args.rows.split(",")]
    if any(r < 1 for r in rows) or args.experts < 1:
        ap.error("--rows and --experts must be positive")
    cuda = torch.cuda.is_available() and not args.small
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = FLASH.replace(n_routed_experts=args.experts)
    if args.small:
        cfg = cfg.replace(dim=64, moe_inter_dim=32, n_activated_experts=min(6, args.experts))
    dt = torch.bfloat16 if cuda else torch.float32
    with torch.device(dev):
        moe = MoE(cfg, cfg.n_hash_layers, Parallel(), dt)     # a score-routed layer (past the hash layers)
    g = torch.Generator(device=dev).manual_seed(0)
    for p in moe.parameters():
        p.data.normal_(0, p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1, generator=g)
    prof = ReuseProfile()                                      # the fanout's defaults (tau 0.9, at least 3)
    header(f"dim {cfg.dim}, inner {cfg.moe_inter_dim}, top-"
           f"{cfg.n_activated_experts} of {args.experts} routed experts, {dt}, fanout {args.fanout}", dev)
    out = dict(experts=args.experts, fanout=args.fanout, rows=[])
    with torch.inference_mode():
        for T in rows:
            x = torch.randn(T, cfg.dim, device=dev, generator=g).to(dt)
            w, idx = moe.gate(x, torch.zeros(T, dtype=torch.long, device=dev))
            if args.fanout == "adaptive":
                w, idx, _ = adaptive_fanout(w, idx, prof.tau, prof.min_experts)
            slots = int((idx >= 0).sum())
            ref = moe.routed_loop(x, w, idx)
            got = moe.routed_grouped(x, w, idx)
            err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
            t_loop, h_loop = timed(lambda: moe.routed_loop(x, w, idx), args.reps, cuda)
            t_grp, h_grp = timed(lambda: moe.routed_grouped(x, w, idx), args.reps, cuda)
            flops = slots * 3 * 2 * cfg.dim * cfg.moe_inter_dim
            row = dict(rows=T, slots=slots, loop_s=t_loop, loop_host_s=h_loop, grouped_s=t_grp, grouped_host_s=h_grp,
                       rel_diff=err, gflop=flops / 1e9)
            out["rows"].append(row)
            print(f"T={T:7d} slots {slots:7d} ({slots / T:.2f}/row): per-expert loop {t_loop * 1e3:8.2f} ms "
                  f"(host {h_loop * 1e3:7.2f} ms, {flops / t_loop / 1e12:6.1f} TFLOP/s)  grouped {t_grp * 1e3:8.2f} ms "
                  f"(host {h_grp * 1e3:7.2f} ms, {flops / t_grp / 1e12:6.1f} TFLOP/s)  x{t_loop / t_grp:.2f}  "
                  f"diff {err:.1e}", flush=True)
    write_json(args.json, out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
