"""mHC kernels benchmark: `hc_pre` (mixing dot + Sinkhorn + collapse) and `hc_post` at Flash's dims (4 streams of
4096 channels, bf16) on T rows, against the copy-bandwidth ceiling measured in the same run.

    python3 bench/mhc.py [--rows 65536,131072] [--reps 20] [--sweep] [--json out.json]

Per row count: the mixing kernel with the float32 FMA dot (SPLIT=0, the kernel before the split dots) and with the
split bf16 tensor-core dots (SPLIT=1, the default for bf16), the whole `hc_pre` (both launches) and `hc_post`, each
timed with CUDA events (median of --reps after a warm-up; inputs rotated over 3 sets so that no run reads the last
run's data from L2), their bytes moved (each input read once, each output written once) over the time, against a
device-to-device copy of 1 GiB timed the same way; and the mixing outputs of the two dots compared with a float64
reference. `--sweep` also times the split kernel over rows per program, K block, stages and warps (first row
count). Not a test: run it through the device tool.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.kernels import mhc  # noqa: E402
from bench.report import header, write_json  # noqa: E402

HC, D, MIX = 4, 4096, 24


def cuda_time(fn, reps: int) -> float:
    fn()
    ts = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn(i)
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1000)
    return statistics.median(ts)


FMA = mhc.mix_config(torch.float32)        # the float32 FMA dot's configuration (what bf16 ran before run 9)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="65536,131072")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/mhc.py needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    buf = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(buf)
    copy_s = cuda_time(lambda i=0: dst.copy_(buf), args.reps)
    copy_bw = 2 * buf.numel() / copy_s
    del buf, dst
    header(f"copy ceiling {copy_bw / 1e12:.2f} TB/s (1 GiB device-to-device, read + write)", dev)
    out = dict(copy_tb_s=copy_bw / 1e12, rows=[])
    for T in (int(v) for v in args.rows.split(",")):
        xs = [torch.randn(T, HC, D, device=dev, generator=g).to(torch.bfloat16) for _ in range(3)]
        ys = [torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16) for _ in range(3)]
        fn = (torch.randn(MIX, HC * D, device=dev, generator=g) * (HC * D) ** -0.5).contiguous()
        base = torch.randn(MIX, device=dev, generator=g) * 0.3
        scale = torch.tensor([0.8, 1.1, 2.0], device=dev)
        n = min(T, 4096)                               # the float64 reference on a slice of the rows
        xr = xs[0][:n].double().flatten(1)
        ref = (xr @ fn.double().T) * torch.rsqrt(xr.square().mean(-1, keepdim=True) + 1e-6)
        err = {}
        for split in (False, True):
            got = mhc.hc_mix(xs[0][:n], fn, 1e-6, None if split else FMA)
            err[split] = rel_err(got, ref)
        x_bytes = T * HC * D * 2
        t_fma = cuda_time(lambda i=0: mhc.hc_mix(xs[i % 3], fn, 1e-6, FMA), args.reps)
        t_split = cuda_time(lambda i=0: mhc.hc_mix(xs[i % 3], fn, 1e-6), args.reps)
        t_pre = cuda_time(lambda i=0: mhc.hc_pre(xs[i % 3], fn, base, scale, 20, 1e-6, 1e-6), args.reps)
        _, _, post, comb = mhc.hc_pre(xs[0], fn, base, scale, 20, 1e-6, 1e-6)
        t_post = cuda_time(lambda i=0: mhc.hc_post(ys[i % 3], xs[i % 3], post, comb), args.reps)
        # bytes: mix reads x; hc_pre reads x twice (mix, then the collapse) and writes the collapsed row;
        # hc_post reads y and x and writes the new streams
        pre_bytes, post_bytes = 2 * x_bytes + T * D * 2, 2 * x_bytes + T * D * 2
        row = dict(rows=T, mix_fma_s=t_fma, mix_split_s=t_split, hc_pre_s=t_pre, hc_post_s=t_post,
                   mix_rel_err_fma=err[False], mix_rel_err_split=err[True],
                   mix_split_tb_s=x_bytes / t_split / 1e12, hc_pre_tb_s=pre_bytes / t_pre / 1e12,
                   hc_post_tb_s=post_bytes / t_post / 1e12)
        print(f"T={T:7d}  mix: FMA dot {t_fma * 1e3:7.3f} ms, split dots {t_split * 1e3:7.3f} ms "
              f"(x{t_fma / t_split:.1f}; {row['mix_split_tb_s']:.2f} TB/s = "
              f"{row['mix_split_tb_s'] * 1e12 / copy_bw:.0%} of copy)  rel err vs float64: FMA {err[False]:.1e}, "
              f"split {err[True]:.1e} | hc_pre {t_pre * 1e3:7.3f} ms "
              f"({row['hc_pre_tb_s']:.2f} TB/s, {row['hc_pre_tb_s'] * 1e12 / copy_bw:.0%}) | hc_post "
              f"{t_post * 1e3:7.3f} ms ({row['hc_post_tb_s']:.2f} TB/s, {row['hc_post_tb_s'] * 1e12 / copy_bw:.0%})",
              flush=True)
        if args.sweep and not out["rows"]:        # the first row count only
            row["sweep"] = []
            for bt, bk, ns, nw in itertools.product([64, 128], [16, 32, 64, 128], [3, 4], [4, 8]):
                cfg = dict(BT=bt, BK=bk, num_stages=ns, num_warps=nw)
                try:
                    t = cuda_time(lambda i=0: mhc.hc_mix(xs[i % 3], fn, 1e-6, cfg), 5)
                    got = mhc.hc_mix(xs[0][:n], fn, 1e-6, cfg)
                except Exception as e:                      # out of shared memory / registers: reported, skipped
                    row["sweep"].append(dict(cfg, error=type(e).__name__))
                    continue
                row["sweep"].append(dict(cfg, s=t, rel_err=rel_err(got, ref)))
            for s in row["sweep"]:
                print(f"           {s}", flush=True)
            ok = [s for s in row["sweep"] if "s" in s and s["rel_err"] <= 1e-5]
            best = min(ok, key=lambda s: s["s"]) if ok else None
            row["best"] = best
            print(f"           sweep best within 1e-5 of float64: {best}"
                  + (f" ({x_bytes / best['s'] / 1e12:.2f} TB/s)" if best else ""), flush=True)
        out["rows"].append(row)
        del xs, ys
        torch.cuda.empty_cache()
    write_json(args.json, out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
