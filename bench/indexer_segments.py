"""The online indexer's two CUDA paths side by side, at a reuse arm's shapes: a query block (the active rows) scored
against several segments' index keys, each in its own frame.

- segment by segment (REDKNOT_INDEXER_SEGMENTS=0): per segment, `rope_` turns the query's RoPE channels to the
  segment's frame, then `indexer_scores` writes that segment's columns;
- one launch (REDKNOT_INDEXER_SEGMENTS=1): `indexer_scores_segments`, the query turned on load in every program.

Shapes: --rows query rows, --segments segments of --entries index keys each (a document's T/4 entries), IH=64,
ID=128 (Flash), rope 64 channels, bf16 (float32 in a CPU smoke run). Prints each path's median time (bench/timing.py) and the largest score
difference between them.

    python3 bench/indexer_segments.py --rows 11533 --segments 9 --entries 4096     # 128K tokens, 10% budget
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.timing import median_time  # noqa: E402
from runtime.kernels import indexer_scores, indexer_scores_segments, rope_  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=11533)
    ap.add_argument("--segments", type=int, default=9)
    ap.add_argument("--entries", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--shapes", default="", help="rows:segments:entries,... (overrides the three above)")
    args = ap.parse_args()
    if torch.cuda.is_available():
        dev = "cuda"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        dev = "cpu"                  # a smoke run under Triton's interpreter (tests): not a measurement
    else:
        sys.exit("bench/indexer_segments.py times CUDA kernels; no GPU here (TRITON_INTERPRET=1 for a smoke run)")
    IH, ID, half = 64, 128, 32
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32     # the interpreter has no bf16 dot
    shapes = ([tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")] if args.shapes
              else [(args.rows, args.segments, args.entries)])
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu, Triton interpreter (not a measurement)"
    print(f"# {name} | torch {torch.__version__} | IH={IH} ID={ID} rope {2 * half} {str(dtype)[6:]}")
    for T, S, E in shapes:
        g = torch.Generator(device=dev).manual_seed(T)
        n_tok = S * 4 * E
        qpos = torch.sort(torch.randperm(n_tok, device=dev, generator=g)[:T]).values
        q = torch.randn(T, IH, ID, device=dev, generator=g).to(dtype)
        w = torch.randn(T, IH, device=dev, generator=g) * IH ** -0.5
        keys = [torch.randn(E, ID, device=dev, generator=g).to(dtype) for _ in range(S)]
        deltas = [j * 4 * E for j in range(S)]
        cols = [j * E for j in range(S)]
        inv = 1.0 / (10000 ** (torch.arange(half, device=dev).float() / half))
        ang = [(qpos - d).float()[:, None] * inv for d in deltas]
        cos, sin = torch.stack([a.cos() for a in ang]), torch.stack([a.sin() for a in ang])
        out_a = torch.empty(T, S * E, device=dev)
        out_b = torch.empty_like(out_a)
        qs = q.clone()

        def by_segment():
            for j in range(S):
                rope_(qs, cos[j], sin[j], src=q)
                indexer_scores(qs, keys[j], w, qpos - deltas[j], out=out_a[:, cols[j]:cols[j] + E])

        blocks = {}

        def one_launch():
            indexer_scores_segments(q, w, qpos, keys, deltas, cols, cos, sin, out_b, blocks=blocks)

        ta, tb = median_time(by_segment, args.reps), median_time(one_launch, args.reps)
        fin = torch.isfinite(out_a)
        assert torch.equal(fin, torch.isfinite(out_b))
        diff = float((out_a[fin] - out_b[fin]).abs().max()) if fin.any() else 0.0
        scale = float(out_a[fin].abs().max()) if fin.any() else 0.0
        print(f"rows {T:6d} segments {S:2d} x {E:5d} entries: by segment {ta * 1e3:8.3f} ms, one launch "
              f"{tb * 1e3:8.3f} ms ({tb / ta:.2f}x); max |diff| {diff:.3g} of max |score| {scale:.3g}")


if __name__ == "__main__":
    main()
