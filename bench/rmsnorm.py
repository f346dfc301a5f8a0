"""The RMS norm: the torch forms (RMSNorm.forward's six passes; unweighted_rms_norm's, the per-head query norm)
against the one-pass Triton kernel (runtime/kernels/rmsnorm.py) on bf16 rows at Flash's widths (weighted: attn_norm /
ffn_norm 4096, q_norm 1024; unweighted: 512 per head, rows x 8 Global heads or x 64 heads), each against a
device-to-device copy of the same bytes timed the same way (the kernel reads each row once and writes it once).

    python3 bench/rmsnorm.py [--rows 16384,131072] [--reps 20] [--json out.json]

CUDA events, median of --reps after a warm-up. Not a test: run it through the device tool.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.kernels.rmsnorm import rms_norm, rms_norm_reference  # noqa: E402
from bench.timing import median_time  # noqa: E402
from bench.report import header, write_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16384,131072")
    ap.add_argument("--dims", default="4096,1024")
    # (per-head rows are rows: 131072 x 8 and 16384 x 64 are one case, 1M rows of 512)
    ap.add_argument("--head-rows", default="131072x8,11469x64",
                    help="unweighted per-head rows, tokens x heads (default: 128K's Global heads over every row, and "
                         "its 10%% active rows' 64 heads)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    header("bf16 rows, float32 weight (or none)", "cuda")
    out = dict(rows=[])
    cases = [(T, dim, True) for dim in (int(v) for v in args.dims.split(","))
             for T in (int(v) for v in args.rows.split(","))]
    cases += [(int(t) * int(h), 512, False) for t, h in (c.split("x") for c in args.head_rows.split(",") if c)]
    for T, dim, weighted in cases:
        x = torch.randn(T, dim, device="cuda").bfloat16()
        w = torch.rand(dim, device="cuda") + 0.5 if weighted else None
        dst = torch.empty_like(x)
        t_ref = median_time(lambda: rms_norm_reference(x, w, 1e-6), args.reps)
        t_k = median_time(lambda: rms_norm(x, w, 1e-6), args.reps)
        t_copy = median_time(lambda: dst.copy_(x), args.reps)
        same = float((rms_norm(x, w, 1e-6) == rms_norm_reference(x, w, 1e-6)).float().mean())
        nbytes = 2 * x.numel() * x.element_size()
        out["rows"].append(dict(dim=dim, rows=T, weighted=weighted, torch_s=t_ref, kernel_s=t_k, copy_s=t_copy,
                                equal_fraction=same))
        print(f"{'weighted' if weighted else 'unweighted'} dim {dim:5d} T={T:8d}: torch form {t_ref * 1e3:7.3f} ms | "
              f"kernel {t_k * 1e3:7.3f} ms ({nbytes / t_k / 1e12:.2f} TB/s, {t_copy / t_k:.0%} of the copy's "
              f"{nbytes / t_copy / 1e12:.2f} TB/s)  x{t_ref / t_k:.1f}  equal elements {same:.4%}", flush=True)
    write_json(args.json, out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
