"""Float32 projections of bf16 rows: the reference path's float32 GEMM (`F.linear(x.float(), w)`, cuBLAS SGEMM on the
CUDA cores) against `runtime.kernels.f32linear.linear_f32` (the weights split exactly into three bf16 pieces, one
bf16 GEMM with float32 output), at the compressors' shapes in Flash (dim 4096; CSA kv + gate 2 x 1024 wide, HCA
2 x 512, the CSA indexer's 2 x 256), each against a float64 product of the same inputs.

    python3 bench/f32linear.py [--rows 16384,131072] [--reps 10] [--json out.json]

Per shape and row count: CUDA time of each form (events, median of --reps after a warm-up; the reference's time
includes its x.float()), its FLOP rate, and its relative error ||y - y64|| / ||y64|| and max |y - y64| / max |y64|.
Not a test: run it through the device tool. `--small` runs tiny shapes on CPU through the reference only (smoke).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.kernels import f32linear  # noqa: E402
from bench.timing import median_time  # noqa: E402
from bench.report import header, write_json  # noqa: E402

SHAPES = {"csa": (1024, 1024), "hca": (512, 512), "indexer": (256, 256)}


def errors(ys, refs) -> tuple[float, float]:
    num = sum(float((y.double() - r).norm() ** 2) for y, r in zip(ys, refs)) ** 0.5
    den = sum(float(r.norm() ** 2) for r in refs) ** 0.5
    mx = max(float((y.double() - r).abs().max()) for y, r in zip(ys, refs))
    return num / den, mx / max(float(r.abs().max()) for r in refs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16384,131072")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [int(v) for v in args.rows.split(",")]
    if any(r < 1 for r in rows) or args.dim < 8 or args.dim % 8:
        ap.error("--rows must be positive and --dim a positive multiple of 8")
    cuda = torch.cuda.is_available() and not args.small
    dev = torch.device("cuda" if cuda else "cpu")
    shapes = {k: (v[0] // 16, v[1] // 16) for k, v in SHAPES.items()} if args.small else SHAPES
    header(f"dim {args.dim}, bf16 rows, float32 weights", dev)
    g = torch.Generator(device=dev).manual_seed(0)
    out = dict(dim=args.dim, rows=[])
    with torch.inference_mode():
        for kind, widths in shapes.items():
            ws = [torch.randn(n, args.dim, device=dev, generator=g) * args.dim ** -0.5 for n in widths]
            for T in rows:
                x = torch.randn(T, args.dim, device=dev, generator=g).to(torch.bfloat16)
                refs = [x.double() @ w.double().t() for w in ws]
                ref32 = [F.linear(x.float(), w) for w in ws]
                e32 = errors(ref32, refs)
                t32 = median_time(lambda: [F.linear(x.float(), w) for w in ws], args.reps)
                flops = 2 * T * args.dim * sum(widths)
                row = dict(kind=kind, rows=T, widths=list(widths), fp32_s=t32, fp32_rel=e32[0], fp32_max=e32[1])
                msg = (f"{kind:8s} T={T:7d} N={'+'.join(map(str, widths))}: float32 GEMM {t32 * 1e3:8.3f} ms "
                       f"({flops / t32 / 1e12:5.1f} TFLOP/s, err {e32[0]:.1e} / max {e32[1]:.1e})")
                if cuda:
                    ys = f32linear.linear_f32(x, *ws)
                    es = errors(ys, refs)
                    ts = median_time(lambda: f32linear.linear_f32(x, *ws), args.reps)
                    row.update(split_s=ts, split_rel=es[0], split_max=es[1])
                    msg += (f" | split bf16 {ts * 1e3:8.3f} ms ({flops / ts / 1e12:5.1f} TFLOP/s, err {es[0]:.1e} / "
                            f"max {es[1]:.1e})  x{t32 / ts:.2f}")
                out["rows"].append(row)
                print(msg, flush=True)
                del x, refs, ref32
    write_json(args.json, out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
