"""GPU kernel benchmark: runtime/kernels against the torch reference path on the same inputs, at long context.

    python3 bench/kernels.py [--lengths 16384,32768,65536,131072] [--json out.json]

- sparse MQA attention (H=64, D=512, W=128, bf16): mode "picks" (CSA: window + top-512 picks of N=T/4 entries),
  "causal" (HCA: window + every visible entry of N=T/128, ratio 128) and "none" (window only); query rows are a
  prefill (cpos = 0..T-1);
- the N-way LSE merge with the sink (3 parts);
- the indexer (IH=64, ID=128, N=T/4 entries, k=512): the scoring kernel alone, and scoring + chunked torch.topk.

Each kernel: median time (triton.testing.do_bench), useful FLOP (valid (query, key) pairs only) and the fewest
bytes (each input read once, each output written once), the two floors against the H200 ceilings of KINDS.md
(bf16 dense ~790 TFLOP/s, copy ~4.2 TB/s), which floor binds, and the reference path's time on the same inputs
(CUDA events, median; one warm-up) and the relative error between the two outputs. Not a test: run it through the
device tool. `--smoke` runs tiny shapes (works on CPU under TRITON_INTERPRET=1, fp16, wall-clock timing).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.kernels import indexer_scores, indexer_topk, merge_lse, sparse_mqa_attention  # noqa: E402
from runtime.kernels.reference import indexer_topk_reference, sparse_mqa_reference  # noqa: E402
from runtime.model.deepseek_v4 import merge_with_sink  # noqa: E402
from bench.report import write_json  # noqa: E402

PEAK_TFLOPS = 790.0       # bf16 dense matrix rate measured on this GPU type (KINDS.md)
PEAK_GBS = 4200.0         # device-to-device copy, bytes read + written (KINDS.md)


class Timer:
    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def kernel(self, fn) -> float:
        """Median seconds of fn (do_bench on CUDA: events, L2 flushed between runs)."""
        if self.cuda:
            import triton.testing
            return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
        return self.ref(fn, 1)[0]

    def ref(self, fn, reps: int):
        """(median seconds, last result) of fn after one warm-up (CUDA events), for the slow reference path."""
        out = fn()
        ts = []
        for _ in range(reps):
            del out
            if self.cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                out = fn()
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts), out


def rel_err(a, b) -> float:
    if torch.isnan(a).any():
        return float("nan")
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def row(name, T, cfg, sec, flop, nbytes, ref_sec=None, err=None, note=""):
    tf = flop / sec / 1e12
    gbs = nbytes / sec / 1e9
    t_flop, t_mem = flop / (PEAK_TFLOPS * 1e12), nbytes / (PEAK_GBS * 1e9)
    r = dict(kernel=name, T=T, config=cfg, ms=sec * 1e3, tflop=flop / 1e12, gbytes=nbytes / 1e9, tflops=tf,
             pct_flops=100 * tf / PEAK_TFLOPS, gbs=gbs, pct_bw=100 * gbs / PEAK_GBS,
             bound="compute" if t_flop >= t_mem else "memory", floor_ms=max(t_flop, t_mem) * 1e3,
             ref_ms=None if ref_sec is None else ref_sec * 1e3,
             speedup=None if ref_sec is None else ref_sec / sec, rel_err=err, note=note)
    print(f"{name:16s} T={T:7d} {sec * 1e3:9.3f} ms  {tf:6.1f} TFLOP/s ({r['pct_flops']:4.1f}%)  "
          f"{gbs:7.0f} GB/s ({r['pct_bw']:4.1f}%)  {r['bound']:7s} floor {r['floor_ms']:8.3f} ms  "
          + (f"ref {ref_sec * 1e3:9.1f} ms  x{ref_sec / sec:6.1f}" if ref_sec else "") +
          (f"  err {err:.1e}" if err is not None else "") + (f"  [{note}]" if note else ""), flush=True)
    return r


def stratified_picks(cpos, n_entries, k, ratio, gen):
    """k distinct causal picks per row: all visible entries when fewer than k (then -1), else one entry drawn from
    each of k equal strata of the visible range (a stand-in for the indexer's top-k)."""
    ready = ((cpos + 1) // ratio).clamp(0, n_entries)[:, None]
    j = torch.arange(k, device=cpos.device)[None, :]
    u = torch.rand(cpos.shape[0], k, device=cpos.device, generator=gen)
    strat = ((j + u) * ready / k).long().clamp(max=n_entries - 1)
    idx = torch.where(ready > k, strat, torch.where(j < ready, j, torch.full_like(j, -1)))
    return idx.to(torch.int32)


def bench_attention(timer, T, H, D, W, k, dtype, dev, ref_max, configs, gen, sweep_all=False):
    """`sweep_all`: every mode tries every config (else the picks mode's best serves the other modes)."""
    rows = []
    q = torch.randn(T, H, D, device=dev, dtype=dtype, generator=gen)
    keys = torch.randn(T, D, device=dev, dtype=dtype, generator=gen)
    cpos = torch.arange(T, device=dev)
    win = (cpos + 1).clamp(max=W)                                              # valid window rows per query
    for mode, ratio in (("picks", 4), ("causal", 128), ("none", 1)):
        N = T // ratio if mode != "none" else 0
        ent = torch.randn(N, D, device=dev, dtype=dtype, generator=gen) if N else None
        picks = stratified_picks(cpos, N, k, ratio, gen) if mode == "picks" else None
        if mode == "picks":
            pairs = int(win.sum()) + int((picks >= 0).sum())
        elif mode == "causal":
            pairs = int(win.sum()) + int(((cpos + 1) // ratio).clamp(max=N).sum())
        else:
            pairs = int(win.sum())
        flop = 4 * H * D * pairs                                               # QK^T and PV, valid pairs only
        nbytes = (T * H * D * q.element_size() + T * H * D * 4 + T * H * 4 + keys.numel() * keys.element_size()
                  + (ent.numel() * ent.element_size() if N else 0) + (picks.numel() * 4 if picks is not None else 0)
                  + T * 8)
        best = None
        for cfg in configs if mode == "picks" or sweep_all else [best_cfg_holder.get("cfg")]:
            fn = lambda cfg=cfg: sparse_mqa_attention(q, keys, cpos, W, ent, mode, ratio, picks, config=cfg)
            sec = timer.kernel(fn)
            if best is None or sec < best[0]:
                best = (sec, cfg)
            if (mode == "picks" or sweep_all) and len(configs) > 1:
                print(f"  {mode} T={T} H={H} config {cfg or 'default'}: {sec * 1e3:.3f} ms", flush=True)
        if mode == "picks":
            best_cfg_holder["cfg"] = best[1]
        sec, cfg = best
        o, lse = sparse_mqa_attention(q, keys, cpos, W, ent, mode, ratio, picks, config=cfg)
        ref_sec = err = None
        if T <= ref_max:
            ref = lambda: sparse_mqa_reference(q, keys, cpos, W, ent, mode, ratio, picks, chunk=4096)
            ref_sec, (ro, _) = timer.ref(ref, 3 if T <= 32768 else 1)
            err = rel_err(o, ro)
            del ro
        rows.append(row(f"attn-{mode}", T, cfg or {}, sec, flop, nbytes, ref_sec, err,
                        f"N={N}" + (f" k={k}" if mode == "picks" else "")))
        del o, lse
        torch.cuda.empty_cache() if dev == "cuda" else None
    return rows


best_cfg_holder: dict = {}


def bench_merge(timer, T, H, D, dev, gen, P=3):
    parts = [(torch.randn(T, H, D, device=dev, generator=gen), torch.randn(T, H, device=dev, generator=gen))
             for _ in range(P)]
    sink = torch.randn(H, device=dev, generator=gen)
    sec = timer.kernel(lambda: merge_lse(parts, sink))
    ref_sec, want = timer.ref(lambda: merge_with_sink(parts, sink), 3)
    err = rel_err(merge_lse(parts, sink), want)
    nbytes = (P + 1) * T * H * D * 4 + P * T * H * 4
    flop = 2 * P * T * H * D
    return [row("merge-lse", T, {}, sec, flop, nbytes, ref_sec, err, f"P={P}")]


def bench_indexer(timer, T, IH, ID, k, dtype, dev, ref_max, configs, gen):
    N = T // 4
    q = torch.randn(T, IH, ID, device=dev, dtype=dtype, generator=gen)
    keys = torch.randn(N, ID, device=dev, dtype=dtype, generator=gen)
    w = torch.randn(T, IH, device=dev, generator=gen) * IH ** -0.5
    cpos = torch.arange(T, device=dev)
    pairs = int(((cpos + 1) // 4).clamp(max=N).sum())
    flop = 2 * IH * ID * pairs
    in_bytes = q.numel() * q.element_size() + keys.numel() * keys.element_size() + w.numel() * 4 + T * 8
    rows = []
    best = None
    out = torch.empty(T, N, device=dev)
    for cfg in configs:
        sec = timer.kernel(lambda cfg=cfg: indexer_scores(q, keys, w, cpos, 4, out=out, config=cfg))
        if len(configs) > 1:
            print(f"  config {cfg or 'default'}: {sec * 1e3:.3f} ms", flush=True)
        if best is None or sec < best[0]:
            best = (sec, cfg)
    sec, cfg = best
    best_cfg_holder["idx_cfg"] = cfg
    rows.append(row("indexer-scores", T, cfg or {}, sec, flop, in_bytes + T * N * 4, note=f"N={N} IH={IH} ID={ID}"))
    del out
    sec = timer.kernel(lambda: indexer_topk(q, keys, w, cpos, k, config=cfg))
    ref_sec = err = None
    if T <= ref_max:
        ref = lambda: indexer_topk_reference(q, keys, w, cpos, k)
        ref_sec, (ridx, rvals) = timer.ref(ref, 3 if T <= 32768 else 1)
        # agreement: the share of the reference's picks that the kernel path also picks
        idx, _ = indexer_topk(q, keys, w, cpos, k, config=cfg)
        both = torch.cat([idx, ridx], dim=1).sort(dim=-1).values
        common = int(((both[:, 1:] == both[:, :-1]) & (both[:, 1:] >= 0)).sum())   # picks are distinct per row
        err = 1.0 - common / max(1, int((ridx >= 0).sum()))
        del idx, ridx, rvals
    rows.append(row("indexer-topk", T, cfg or {}, sec, flop, in_bytes + T * min(k, N) * 16, ref_sec, err,
                    f"k={k}; err = share of reference picks not picked"))
    return rows


def ceilings(dev):
    """Measure the two ceilings once on this GPU (random data)."""
    import triton.testing
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm = triton.testing.do_bench(lambda: a @ b, return_mode="median") / 1e3
    x = torch.randn(1 << 30, device=dev)
    y = torch.empty_like(x)
    cp = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median") / 1e3
    r = dict(bf16_tflops=2 * 8192 ** 3 / mm / 1e12, copy_gbs=2 * x.numel() * 4 / cp / 1e9)
    del a, b, x, y
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="16384,32768,65536,131072")
    ap.add_argument("--ref-max", type=int, default=131072, help="largest T at which the reference is timed")
    ap.add_argument("--merge-max", type=int, default=65536)
    ap.add_argument("--what", default="attn,merge,indexer")
    ap.add_argument("--tune", action="store_true", help="try several block configs at the first length")
    ap.add_argument("--heads", type=int, default=64, help="attention heads of the sparse-attention calls (the reuse "
                    "consumer's Global heads' calls have 8)")
    ap.add_argument("--grid", default=None, help="sparse-attention configs to sweep in every mode beside the default, "
                    "e.g. 'BLOCK_N=32,num_warps=4;BLOCK_N=64,num_stages=3'")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    H, D, W, K, IH, ID = args.heads, 512, 128, 512, 64, 128
    lengths = [int(v) for v in args.lengths.split(",")]
    if args.smoke:
        H, D, W, K, IH, ID, lengths = 16, 64, 16, 32, 8, 32, [256]
    timer = Timer(dev)
    info = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
                when=time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    if dev == "cuda":
        info["cuda"] = torch.version.cuda
        try:
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as e:  # noqa: BLE001
            info["nvidia_smi"] = repr(e)
        info["ceilings_measured"] = ceilings(dev)
    print(f"# {info}", flush=True)
    what = set(args.what.split(","))
    attn_cfgs = [None]
    idx_cfgs = [None]
    if args.tune:
        attn_cfgs = [None, dict(BLOCK_N=32), dict(DV=256, BLOCK_N=32), dict(BLOCK_H=32, BLOCK_N=64, num_warps=8),
                     dict(BLOCK_H=16, BLOCK_N=64, num_warps=4)]
        idx_cfgs = [None, dict(BLOCK_T=128, BLOCK_N=128, num_warps=8, num_stages=3),
                    dict(BLOCK_T=64, BLOCK_N=256, num_warps=8, num_stages=3),
                    dict(BLOCK_T=128, BLOCK_N=64, num_warps=4, num_stages=3)]
    if args.grid:
        attn_cfgs = [None] + [{k: int(v) for k, v in (kv.split("=") for kv in c.split(","))}
                              for c in args.grid.split(";") if c.strip()]
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for i, T in enumerate(lengths):
        if "attn" in what:
            rows += bench_attention(timer, T, H, D, W, K, dtype, dev, args.ref_max, attn_cfgs if i == 0 or args.grid
                                    else [best_cfg_holder.get("cfg")], gen, sweep_all=bool(args.grid))
        if "merge" in what and T <= args.merge_max:
            rows += bench_merge(timer, T, H, D, dev, gen)
        if "indexer" in what:
            rows += bench_indexer(timer, T, IH, ID, K, dtype, dev, args.ref_max, idx_cfgs if i == 0 else
                                  [best_cfg_holder.get("idx_cfg")], gen)
        if dev == "cuda":
            torch.cuda.empty_cache()
    print("\n| kernel | T | ms | TFLOP/s (% of 790) | GB/s (% of 4200) | bound | floor ms | reference ms | speedup | "
          "rel. err vs reference |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        ref = f"{r['ref_ms']:.1f}" if r["ref_ms"] is not None else "-"
        sp = f"{r['speedup']:.1f}x" if r["speedup"] is not None else "-"
        err = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "-"
        print(f"| {r['kernel']} | {r['T']} | {r['ms']:.2f} | {r['tflops']:.1f} ({r['pct_flops']:.0f}%) | "
              f"{r['gbs']:.0f} ({r['pct_bw']:.0f}%) | {r['bound']} | {r['floor_ms']:.2f} | {ref} | {sp} | {err} |")
    write_json(args.json, dict(info=info, rows=rows, best=best_cfg_holder), args, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
