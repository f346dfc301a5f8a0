"""Host time of a request's row plan (runtime/reuse/rows.py `split_rows` with every compressor geometry of the
Flash profile's reusable layers: ratio 4 with overlap, ratio 128 without) by request length and document count:
the host work the reuse arm does once per request, before its first reusable layer, while the GPU waits.

    python3 bench/row_plan.py [--lengths 32768,131072] [--docs 8,16,32,64] [--budget 0.1] [--reps 20]

Even document lengths, a random active mask at --budget, a 64-row question; positions on the CPU (the plan is host
work: numpy, and one host->device copy per plan where the positions are on a GPU). Median of --reps.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.report import header, write_json  # noqa: E402
from runtime.reuse.rows import split_rows  # noqa: E402

GEOMETRIES = [(4, True), (128, False)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--docs", default="8,16,32,64")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device(args.device)
    header(f"split_rows, geometries {GEOMETRIES}, budget {args.budget:.0%}", dev)
    rows = []
    for L in (int(v) for v in args.lengths.split(",")):
        for n_docs in (int(v) for v in args.docs.split(",")):
            n = L // n_docs
            reloc = [types.SimpleNamespace(n=n) for _ in range(n_docs - 1)]   # document 1 is the prefix
            g = torch.Generator().manual_seed(n_docs)
            active = (torch.rand(n * (n_docs - 1), generator=g) < args.budget).to(dev)
            positions = torch.arange(n, n * n_docs + 64, device=dev)
            times = []
            for _ in range(args.reps + 1):
                t0 = time.perf_counter()
                split_rows(active, positions, reloc, 64, GEOMETRIES)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times[1:])
            rows.append(dict(tokens=L, docs=n_docs, s=med))
            print(f"{L:7d} tokens x {n_docs:2d} documents: {med * 1e3:7.2f} ms", flush=True)
    write_json(args.json, dict(budget=args.budget, geometries=GEOMETRIES, rows=rows), args, dev)


if __name__ == "__main__":
    main()
