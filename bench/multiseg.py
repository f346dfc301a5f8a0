"""Multi-segment attention benchmark: the consumer's two paths over the same segments, rows and picks.

    python3 bench/multiseg.py [--length 32768] [--docs 8] [--budget 0.1] [--sweep] [--json out.json]

A request of --length tokens as --docs documents (the first is the prefix) plus 64 question rows, at real
dimensions (D = 512, 64 rope channels, window 128, bf16). Two row sets, as runtime/reuse/engine.py forms them:
- "active": --budget of the relocated rows plus the question rows, all 64 heads; CSA picks are the online
  indexer's top-512 over the union of every segment's visible entries (random ids here, drawn from the same range);
- "global": the other relocated rows, the 8 Global heads; CSA picks are each row's own document's 512 (artifact),
  or with `--global-picks online` (the flash preset's) the indexer's top-512 over every segment, as for "active".
Per row set and layer kind (window, HCA ratio 128, CSA ratio 4): the stacked path (one sparse-attention launch per
segment part into a float32 [parts, rows, heads, D] buffer, then the N-way merge: a policy whose fused_min_heads
no call reaches) and the fused multi-segment kernel (runtime/kernels/multiseg.py through segments.fused_attention,
the default policy's frame), each timed with CUDA events (median
of --reps after a warm-up) on rows in chunks of --q-chunk x 64 / heads (as the consumer's `_attend`), plus the
relative difference of their outputs. `--sweep` also times the fused path (under --policy when given) over a grid
of block sizes (for 8 heads: query rows per program, the packed kernel or in the key frame the key-frame kernel's
rows; ROWS = 1 is the one-row kernel).
Not a test: run it through the device tool.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.timing import median_time  # noqa: E402
import runtime.reuse.segments as C  # noqa: E402
from runtime.reuse.picks import split_picks  # noqa: E402
from runtime.model.config import CSA, HCA, WINDOW  # noqa: E402
from runtime.model.deepseek_v4 import Rotary  # noqa: E402
from runtime.policy import RuntimePolicy  # noqa: E402
from bench.report import header, write_json  # noqa: E402

STACKED = RuntimePolicy(fused_min_heads=1 << 30, fused_min_segments=1 << 30,     # every call: stacked parts
                        key_frame_min_segments_hca=0)

D, W, ROPE, K = 512, 128, 64, 512
DT = torch.bfloat16          # --fp32: float32 (the CPU smoke run: the interpreter has no bf16 of its own)
RATIO = {"window": 0, "hca": 128, "csa": 4}


def layer(kind: str, dev) -> types.SimpleNamespace:
    rot = Rotary(1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, device=dev).float() / ROPE)))
    return types.SimpleNamespace(kind={"window": WINDOW, "hca": HCA, "csa": CSA}[kind], ratio=RATIO[kind],
                                 scale=D ** -0.5, rotary=rot, indexer=None, cfg=types.SimpleNamespace(window_size=W))


def request(args, dev, g):
    per = (args.length // args.docs) // 128 * 128
    lens = [per] * args.docs + [64]
    deltas = [sum(lens[:j]) for j in range(len(lens))]
    lat = [torch.randn(n, D, device=dev, generator=g).to(DT) for n in lens]
    reloc = torch.arange(per, sum(lens) - 64, device=dev)
    pick = torch.rand(reloc.numel(), device=dev, generator=g) < args.budget
    question = torch.arange(sum(lens) - 64, sum(lens), device=dev)
    rows = {"active": torch.cat([reloc[pick], question]), "global": reloc[~pick]}
    return lens, deltas, lat, rows


def segments(kind, lens, deltas, lat, dev, g):
    r = RATIO[kind]
    return [C.SegmentKeys(d, x, torch.randn(n // r, D, device=dev, generator=g).to(DT) if r else None)
            for n, d, x in zip(lens, deltas, lat)]


def online_picks(rows, deltas, lens, dev, g):
    """[T, K] global entry ids (CSA, ratio 4) drawn from each row's visible entries over the union of segments."""
    first = torch.tensor([sum(n // 4 for n in lens[:j]) for j in range(len(lens))], device=dev)
    own = torch.searchsorted(torch.tensor(deltas, device=dev), rows, right=True) - 1
    vis = first[own] + (rows - torch.tensor(deltas, device=dev)[own] + 1) // 4
    ids = (torch.rand(rows.numel(), K, device=dev, generator=g) * vis[:, None]).long()
    return torch.where(vis[:, None] > 0, ids, first[-1] + lens[-1] // 4), first.tolist(), sum(n // 4 for n in lens)


def own_picks(rows, deltas, lens, dev, g):
    own = torch.searchsorted(torch.tensor(deltas, device=dev), rows, right=True) - 1
    vis = (rows - torch.tensor(deltas, device=dev)[own] + 1) // 4
    ids = (torch.rand(rows.numel(), K, device=dev, generator=g) * vis[:, None]).long()
    return torch.where(torch.arange(K, device=dev)[None, :] < vis[:, None], ids, -1)


GRID_KEYS = ("BLOCK_N", "num_warps", "num_stages")


def sweep_grid(spec: str | None, heads: int) -> list[list[int]]:
    """The sweep's values per key, in the order (BLOCK_H or ROWS, BLOCK_N, num_warps, num_stages): BLOCK_H (heads
    per program) for calls of >= 16 heads, ROWS (query rows per program) for fewer. `spec`
    ("ROWS=1,2,4;num_stages=1" etc.) replaces some keys' default lists."""
    grid = {"BLOCK_H": [32, 64], "ROWS": [1, 2, 4, 8], "BLOCK_N": [16, 32, 64], "num_warps": [4, 8],
            "num_stages": [1, 3]}
    for part in filter(None, (spec or "").split(";")):
        key, _, vals = (x.strip() for x in part.partition("="))
        if key not in grid:
            raise SystemExit(f"--grid: unknown key {key!r} (keys: {', '.join(grid)})")
        try:
            grid[key] = [int(v) for v in vals.split(",") if v.strip()]
        except ValueError:
            raise SystemExit(f"--grid: {part!r} is not KEY=int,int,...") from None
        if not grid[key] or min(grid[key]) < 1:
            raise SystemExit(f"--grid: {part!r} needs positive values")
    return [grid["BLOCK_H" if heads >= 16 else "ROWS"]] + [grid[k] for k in GRID_KEYS]


def case(args, kind, which, lens, deltas, lat, rows_all, dev, g):
    attn = layer(kind, dev)
    segs = segments(kind, lens, deltas, lat, dev, g)
    rows = rows_all[which]
    H = 64 if which == "active" else 8
    q = torch.randn(rows.numel(), H, D, device=dev, generator=g).to(DT)
    sink = torch.randn(H, device=dev, generator=g)
    host = rows.cpu().numpy()
    step = max(1, args.q_chunk * 64 // H)
    chunks = [slice(a, a + step) for a in range(0, rows.numel(), step)]
    # per chunk the consumer's per-request cache (`Rows.trig`): tables made once per rows, reused by every layer
    trigs = [{} for _ in chunks]
    online = kind == "csa" and (which == "active" or args.global_picks == "online")
    own = own_picks(rows, deltas, lens, dev, g) if kind == "csa" and not online else None
    mode, gp, first, total = {"window": "none", "hca": "causal"}.get(kind, "picks"), None, None, None
    if online:
        gp, first, total = online_picks(rows, deltas, lens, dev, g)
        per_seg = split_picks(gp, first, total)
    elif own is not None:
        first, total = C.offsets(segs, "entries")

    def stacked():
        return torch.cat([C.segment_attention(attn, q[c], rows[c], segs, sink, qpos_host=host[c],
                                              own_picks=None if own is None else own[c],
                                              picks=[p[c] for p in per_seg] if online else None,
                                              trig=tr, policy=STACKED)[0]
                          for c, tr in zip(chunks, trigs)])

    def fused(config=None, policy=C.DEFAULT_POLICY):
        """The consumer's fused call per chunk (segments.fused_attention), own picks turned global inside it."""
        outs = []
        for c, tr in zip(chunks, trigs):
            gpc = gp[c] if online else None if own is None else C.own_global_picks(segs, rows[c], own[c], first,
                                                                                     total)
            outs.append(C.fused_attention(attn, q[c], rows[c], segs, sink, host[c], mode, gpc, first, total,
                                          config, trig=tr, policy=policy)[0])
        return torch.cat(outs)

    a, b = stacked(), fused()
    err = ((a.float() - b.float()).norm() / a.float().norm().clamp_min(1e-30)).item()
    res = dict(kind=kind, rows=which, heads=H, n_rows=rows.numel(), picks="online" if online else
               ("own" if own is not None else None), stacked_s=median_time(stacked, args.reps),
               fused_s=median_time(fused, args.reps), rel_diff=err)
    if args.fused_policy is not None:      # the fused arm again under the --policy items, beside the default
        pol = args.fused_policy
        res["policy"], res["policy_s"] = pol.diff(), median_time(lambda: fused(policy=pol), args.reps)
    if args.sweep:
        res["sweep"] = []
        # 64 heads: heads per program; 8 heads: rows per program (ROWS = 1: one row, its heads padded to 16)
        grid = itertools.product(*sweep_grid(args.grid, H))
        for b, bn, nw, ns in grid:
            cfg = dict(BLOCK_H=b, BLOCK_N=bn, num_warps=nw, num_stages=ns) if H >= 16 else \
                dict(ROWS=b, BLOCK_N=bn, num_warps=nw, num_stages=ns)
            try:
                t = median_time(lambda: fused(cfg, args.fused_policy or C.DEFAULT_POLICY), 2)
            except Exception as e:                          # out of shared memory / registers: reported, skipped
                res["sweep"].append(dict(cfg, error=type(e).__name__))
                continue
            res["sweep"].append(dict(cfg, s=t))
        best = min((s for s in res["sweep"] if "s" in s), key=lambda s: s["s"])
        res["best"] = best
    print(f"{kind:6s} {which:6s} H={H:2d} rows={rows.numel():6d} picks={res['picks']}: stacked "
          f"{res['stacked_s'] * 1e3:8.2f} ms  fused {res['fused_s'] * 1e3:8.2f} ms  "
          f"(x{res['stacked_s'] / res['fused_s']:.2f})  diff {err:.1e}"
          + (f"  fused under --policy {res['policy_s'] * 1e3:8.2f} ms" if "policy_s" in res else "")
          + (f"  best {res['best']}" if args.sweep else ""), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--q-chunk", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kinds", default="window,hca,csa")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--rows", default="active,global", help="row sets: active (64 heads), global (8 heads)")
    ap.add_argument("--grid", default=None,
                    help='--sweep values per key, e.g. "ROWS=1,2,4;BLOCK_N=32,64;num_warps=4" (keys BLOCK_H or ROWS, '
                         'BLOCK_N, num_warps, num_stages; the others keep their default lists)')
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--global-picks", default="artifact", choices=["artifact", "online"],
                    help="the Global rows' CSA picks: each row's own document's (artifact) or the indexer's over "
                         "every segment (online, the flash preset's)")
    ap.add_argument("--policy", action="append", default=[], metavar="KEY=VALUE",
                    help="also time the fused arm under the default policy with these fields changed (repeatable: "
                         "runtime/policy.py names them, e.g. key_frame_min_segments_hca=2)")
    ap.add_argument("--json")
    args = ap.parse_args()
    sweep_grid(args.grid, 8)                              # a bad --grid fails before any work
    try:                                                  # ... and a bad --policy
        args.fused_policy = RuntimePolicy.parse(args.policy) if args.policy else None
    except ValueError as e:
        raise SystemExit(f"--policy: {e}") from None
    global DT
    DT = torch.float32 if args.fp32 else torch.bfloat16
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        print("bench/multiseg.py needs a GPU (or TRITON_INTERPRET=1 and a tiny --length for a CPU smoke run)",
              file=sys.stderr)
        return 2
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=dev).manual_seed(0)
    lens, deltas, lat, rows = request(args, dev, g)
    header(f"length {args.length}, docs {args.docs}, budget {args.budget}", dev)
    out = [case(args, kind, which, lens, deltas, lat, rows, dev, g)
           for kind in args.kinds.split(",") for which in args.rows.split(",")]
    tot_s, tot_f = sum(r["stacked_s"] for r in out), sum(r["fused_s"] for r in out)
    print(f"all cases: stacked {tot_s * 1e3:.1f} ms, fused {tot_f * 1e3:.1f} ms (x{tot_s / tot_f:.2f})")
    write_json(args.json, dict(cases=out), args, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
