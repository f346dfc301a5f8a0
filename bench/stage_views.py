"""Host time of staging one layer's views for a request's documents (runtime/reuse/packing.py `pack_documents`, as
LayerPrefetcher calls it for pinned documents: one slot copy per document, then each document's views rebuilt on
the slot) by document count: host work done once per reusable layer of every request, which grows with the
documents (issue 34's "staging views").

    python3 bench/stage_views.py [--docs 8,16,32,64] [--rows 128] [--layers 43] [--reps 10]

Each document's layer holds the fields of a Flash reusable layer (alternating CSA and HCA layers, FP8 Local
contribution with its scales, stored picks on CSA layers), packed as the hot tier packs them (`pin_layers`); --rows
rows per document (the views' cost does not depend on the rows; a small count keeps the bench in memory). The copy
is left out (a no-op): what is timed is the host's layout and view work. Median of --reps, per layer.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.report import header, write_json  # noqa: E402
from runtime.model.config import FLASH  # noqa: E402
from runtime.reuse.artifact import LayerArtifact  # noqa: E402
from runtime.reuse.packing import host_plan, pack_documents, pin_layers  # noqa: E402

F = FLASH


def flash_layer(n: int, csa: bool) -> LayerArtifact:
    """A Flash reusable layer's artifact of `n` rows (CSA: ratio 4 with indexer keys and stored picks; HCA: ratio
    128), FP8 Local contribution W_a,L O_L (o_groups x o_lora_rank channels) and its scales; values irrelevant."""
    ratio = 4 if csa else 128
    local = F.o_groups * F.o_lora_rank

    def carried(width: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(ratio, width), torch.zeros(ratio, width)
    return LayerArtifact(
        latent=torch.zeros(n, F.head_dim, dtype=torch.bfloat16),
        entries=torch.zeros(max(n // ratio, 1), F.head_dim, dtype=torch.bfloat16),
        index_keys=torch.zeros(n // ratio, F.index_head_dim, dtype=torch.bfloat16) if csa else None,
        comp_prev=carried(2 * F.head_dim), index_prev=carried(2 * F.index_head_dim) if csa else None,
        local_p=torch.zeros(n, local, dtype=torch.float8_e4m3fn),
        picks=torch.zeros(n, F.index_topk, dtype=torch.int32) if csa else None,
        local_s=torch.zeros(n, local // 128, dtype=torch.uint8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", default="8,16,32,64")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    header(f"pack_documents host time, {args.layers} layers, {args.rows} rows a document", "cpu")
    rows = []
    for n_docs in (int(v) for v in args.docs.split(",")):
        layers = [[pin_layers([flash_layer(args.rows, i % 2 == 0)])[0] for _ in range(n_docs)]
                  for i in range(args.layers)]
        plans = [[host_plan(la) for la in docs] for docs in layers]
        flat = torch.empty(max(sum(p[1][1] for p in hp) for hp in plans) * 2, dtype=torch.uint8)
        times = []
        for _ in range(args.reps + 1):                  # the first pass (allocator and caches warming) apart
            t0 = time.perf_counter()
            for docs, hp in zip(layers, plans):
                pack_documents(docs, "cpu", lambda slot, src: None, [src for _, _, src in hp],
                               lambda k: flat[:k], [(ts, lay) for ts, lay, _ in hp])
            times.append((time.perf_counter() - t0) / args.layers)
        first, med = times[0], statistics.median(times[1:])
        rows.append(dict(docs=n_docs, first_s=first, s=med))
        print(f"{n_docs:2d} documents: {med * 1e3:6.2f} ms a layer ({first * 1e3:6.2f} ms on the first pass)",
              flush=True)
    write_json(args.json, dict(rows=rows, layers=args.layers, doc_rows=args.rows), args, "cpu")


if __name__ == "__main__":
    main()
