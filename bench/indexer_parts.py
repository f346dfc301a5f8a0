"""The online indexer over a request's relocated segments, at a reuse arm's shapes: the active rows' index query
scored against every segment's index keys, each in its own frame.

- segment by segment (what the consumer did up to issue 34; kept here only as the baseline, composed from the
  public kernels): per segment, `rope_` turns the query's RoPE channels to t - Delta_j, then `indexer_scores`
  writes that segment's columns;
- one launch (`runtime/reuse/picks.py` now): the query roped once at t, then `indexer_scores_parts`, every
  program turning its key tile by +Delta_j as it loads it (q(t - D) . k = q(t) . k(+D)).

Shapes: rows:segments:entries (a document's n/4 entries), IH=64, ID=128 (Flash), 64 RoPE channels (YaRN), bf16.
Prints each path's median time (bench/timing.py) and the largest score difference between them.

    python3 bench/indexer_parts.py --shapes 6560:8:2048,6560:32:512,13120:32:1024,13120:64:512
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.report import header, write_json  # noqa: E402
from bench.timing import median_time  # noqa: E402
from runtime.kernels import indexer_scores, indexer_scores_parts, parts_programs, rope_  # noqa: E402
from runtime.model.deepseek_v4 import Rotary, yarn_inv_freq  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="6560:8:2048,6560:32:512,13120:32:1024,13120:64:512",
                    help="rows:segments:entries,...")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if torch.cuda.is_available():
        dev = "cuda"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        dev = "cpu"                  # a smoke run under Triton's interpreter: not a measurement
    else:
        sys.exit("bench/indexer_parts.py times CUDA kernels; no GPU here (TRITON_INTERPRET=1 for a smoke run)")
    IH, ID = 64, 128
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32     # the interpreter has no bf16 dot
    rot = Rotary(yarn_inv_freq(64, 160000.0, 16.0, 65536, 32.0, 1.0))
    header(f"IH={IH} ID={ID} rope 64 {str(dtype)[6:]}", dev)
    results = []
    for spec in args.shapes.split(","):
        T, S, E = (int(v) for v in spec.split(":"))
        g = torch.Generator(device=dev).manual_seed(T + S)
        n_tok = S * 4 * E
        qpos = torch.sort(torch.randperm(n_tok, device=dev, generator=g)[:T]).values
        q_raw = torch.randn(T, IH, ID, device=dev, generator=g).to(dtype)
        w = torch.randn(T, IH, device=dev, generator=g) * IH ** -0.5
        keys = [torch.randn(E, ID, device=dev, generator=g).to(dtype) for _ in range(S)]
        deltas = [j * 4 * E for j in range(S)]
        per_seg = [rot.cos_sin(qpos - d) for d in deltas]
        at_t = rot.cos_sin(qpos)
        cs = torch.stack(rot.cos_sin(torch.tensor(deltas, device=dev)), dim=1)
        programs = parts_programs([E] * S, dev)
        out_a = torch.empty(T, S * E, device=dev)
        out_b = torch.empty_like(out_a)
        qs, q = q_raw.clone(), q_raw.clone()

        def by_segment():
            for j in range(S):
                rope_(qs, *per_seg[j], src=q_raw)
                indexer_scores(qs, keys[j], w, qpos - deltas[j], out=out_a[:, j * E:(j + 1) * E])

        def one_launch():
            rope_(q, *at_t, src=q_raw)
            indexer_scores_parts(q, keys, deltas, cs, w, qpos, out_b, programs=programs)

        ta, tb = median_time(by_segment, args.reps), median_time(one_launch, args.reps)
        fin = torch.isfinite(out_a)
        assert torch.equal(fin, torch.isfinite(out_b))
        diff = float((out_a[fin] - out_b[fin]).abs().max()) if fin.any() else 0.0
        scale = float(out_a[fin].abs().max()) if fin.any() else 0.0
        print(f"rows {T:6d} segments {S:2d} x {E:5d} entries: by segment {ta * 1e3:8.3f} ms, one launch "
              f"{tb * 1e3:8.3f} ms ({ta / tb:.2f}x faster); max |diff| {diff:.3g} of max |score| {scale:.3g}")
        results.append(dict(rows=T, segments=S, entries=E, by_segment_s=ta, one_launch_s=tb, max_diff=diff,
                            max_score=scale))
    write_json(args.json, dict(shapes=results), args, dev)


if __name__ == "__main__":
    main()
