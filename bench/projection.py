"""W_a per group without copies: the einsum form the model had (it permutes its result and copies it) against
`grouped_projection` (one batched GEMM over strided views, the result written in place), for the native and active
rows (every head: o [T, 8, 4096]) and for the reuse consumer's non-active rows (the Global heads' W_a,G O_G plus the
restored W_a,L O_L): before, an einsum over a copied weight slice, then per document an index_select and an add;
now the Local rows gathered straight into place (`views.gather_rows`) and the Global product added to them in
the same GEMM (beta = 1, one rounding). Flash's dims: 8 groups of 1024, 64 heads of 512, one Global head per group.

    python3 bench/projection.py [--rows 16384,131072] [--docs 8] [--rest 0.9] [--reps 10] [--json out.json]
    python3 bench/projection.py --small ...       # CPU smoke run (tiny dims; not a measurement)

CUDA events, median of --reps after a warm-up. Not a test: run it through the device tool.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.model.deepseek_v4 import grouped_projection  # noqa: E402
from runtime.reuse.views import gather_rows  # noqa: E402
from bench.timing import median_time  # noqa: E402
from bench.report import header, write_json  # noqa: E402


def einsum_form(o, w):
    """The previous form of Attention.project_relative and ReuseEngine._project_global."""
    T, G, R = o.shape[0], w.shape[0], w.shape[1]
    return torch.einsum("tgi,gri->tgr", o, w).reshape(T, G * R)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16384,131072")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--rest", type=float, default=0.9, help="fraction of each document's rows that are non-active")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="tiny dims (CPU smoke run)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not 0.0 < args.rest <= 1.0 or args.docs < 1:
        ap.error("--rest in (0, 1] and --docs >= 1")
    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        ap.error("needs a CUDA device (or --small for a CPU smoke run)")
    dev = "cuda" if cuda else "cpu"
    G, R, hpg, D = (8, 1024, 8, 512) if not args.small else (2, 16, 4, 8)
    header(f"bf16, {G} groups x {R}, {G * hpg} heads of {D}", dev)
    out = dict(groups=G, rank=R, heads=G * hpg, head_dim=D, rows=[])
    gen = torch.Generator(device="cpu").manual_seed(0)
    w_full = (torch.randn(G, R, hpg * D, generator=gen) * (hpg * D) ** -0.5).bfloat16().to(dev)
    for T in (int(v) for v in args.rows.split(",")):
        o = torch.randn(T, G, hpg * D, generator=gen).bfloat16().to(dev)
        t_ein = median_time(lambda: einsum_form(o, w_full), args.reps)
        t_grp = median_time(lambda: grouped_projection(o, w_full), args.reps)
        diff_all = float((einsum_form(o, w_full).float() - grouped_projection(o, w_full).float()).abs().max())
        del o
        # non-active rows: `rest` of each document's rows, the Global head (the first of each group) online
        n_doc = T // args.docs
        parts, off = [], 0
        locals_ = [torch.randn(n_doc, G * R, generator=gen).bfloat16().to(dev) for _ in range(args.docs)]
        for src in locals_:
            ids = torch.sort(torch.randperm(n_doc, generator=gen)[:max(1, int(args.rest * n_doc))]).values.to(dev)
            parts.append((src, ids, off))
            off += ids.numel()
        n_rest = off
        og = torch.randn(n_rest, G, D, generator=gen).bfloat16().to(dev)
        wg_view = w_full.view(G, R, hpg, D)[:, :, :1].reshape(G, R, D)

        def before():
            pg = einsum_form(og, w_full.view(G, R, hpg, D)[:, :, :1].reshape(G, R, D).contiguous())
            for src, ids, o0 in parts:
                pg[o0:o0 + ids.numel()].add_(src.index_select(0, ids))
            return pg

        def after():
            return grouped_projection(og, wg_view, gather_rows(parts, n_rest, G * R, og.dtype, og.device))

        t_before = median_time(before, args.reps)
        t_after = median_time(after, args.reps)
        exact = (einsum_form(og.double(), wg_view.double())
                 + torch.cat([s.index_select(0, i) for s, i, _ in parts]).double())
        err_before = float((before().double() - exact).abs().max() / exact.abs().max())
        err_after = float((after().double() - exact).abs().max() / exact.abs().max())
        row = dict(rows=T, all_heads_einsum_s=t_ein, all_heads_grouped_s=t_grp, all_heads_max_abs_diff=diff_all,
                   rest_rows=n_rest, restore_before_s=t_before, restore_after_s=t_after,
                   restore_rel_err_before=err_before, restore_rel_err_after=err_after)
        out["rows"].append(row)
        print(f"T={T:7d}: every head  einsum {t_ein * 1e3:7.3f} ms | grouped {t_grp * 1e3:7.3f} ms "
              f"x{t_ein / t_grp:.2f} (max |diff| {diff_all:.2e})", flush=True)
        print(f"           {n_rest} non-active rows: before {t_before * 1e3:7.3f} ms | now {t_after * 1e3:7.3f} ms "
              f"x{t_before / t_after:.2f}  (max error vs float64, of max |P|: before {err_before:.2e}, "
              f"now {err_after:.2e})", flush=True)
        del og, locals_, parts
    write_json(args.json, out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
