"""TTFT benchmark: a DeepSeek-V4-Flash-shaped model at real dimensions, all 43 layers (routed experts reduced to
fit one GPU; printed), hot artifacts in pinned host memory staged one layer ahead on a copy stream, the
recompute arm and the reuse arm on the same tokens and offsets. TTFT = model-forward entry to the first token's
logits, after --warmup untimed runs, median of --reps. Beside each measured speedup: the ledger's four
namespaces and the analytic FLOP ratio. Also the cold arm (artifact construction included) at --cold-at. Not a test.

    python bench/ttft.py --lengths 16384,32768,65536,131072 --experts 16 --json ttft.json --plot ttft.png

    python bench/ttft.py --lengths 131072 --cold-at 0 --extra-budgets 0.1 --json a.json   # one length per call
    python bench/ttft.py --plot-from a.json b.json --plot ttft.png                         # plot earlier runs
    python bench/ttft.py --plot-from a.json --cold-from c.json --plot ttft.png              # cold arm from run c
    python bench/ttft.py --lengths 65536 --docs 8,16,32,64 --doc-lengths loguniform:256:8192 --budget 0.1 --cold-at 0

`--docs` takes a list of document counts (every length is measured at every count); `--doc-lengths` draws uneven
document lengths (log-uniform on [LO, HI], scaled to fill the length exactly) from the length's seed.

Wall time on one H200 (2026-11-30): 16K + 32K with a second budget ~3 min, 64K with the cold arm ~4.5 min, 128K
~6.5 min (per length: artifact build and pinning, a warm-up and --reps interleaved runs of every arm; the recompute
arm takes 3.3 s at 16K and 28 s at 128K). Give each long length its own call under a 10-minute limit.
`--extra-budgets` times more reuse budgets on the same artifacts (they do not depend on the budget). `--tp N`
(N > 1) runs bench/ttft_tp.py: one process per GPU over NCCL. Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
at 128K (peak 128 GiB of the H200's 140).

Memory: at 128K the hot artifacts are ~75 GiB (Local W_a,L O_L 65 GiB of it: 8 x 1024 bf16 per relocated row and
reusable layer), all in pinned host memory; each length prints its breakdown, a length whose artifacts exceed
--host-budget-gib is skipped, and pinned blocks are released between lengths.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.syncs import allocator_counters, allocator_delta, sync_report  # noqa: E402
from runtime.model.config import CSA, FLASH  # noqa: E402
from runtime.model.deepseek_v4 import Transformer  # noqa: E402
from runtime.model.quant import FP8_ROW_BLOCK  # noqa: E402
from runtime.model.random_init import init_random  # noqa: E402
from runtime.policy import RuntimePolicy  # noqa: E402
from runtime.reuse.artifact import DocumentArtifact  # noqa: E402
from runtime.reuse.engine import ReuseEngine  # noqa: E402
from runtime.reuse.packing import pin  # noqa: E402
from runtime.reuse.prefetcher import LayerPrefetcher  # noqa: E402
from runtime.reuse.producer import produce  # noqa: E402
from runtime.reuse.profile import FLASH_PROFILE  # noqa: E402
from bench.report import header, write_json  # noqa: E402


def _at_least_one(v: str) -> int:
    """An argparse type: an int >= 1 (a count of runs that must happen), else argparse's own clear error."""
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v!r}")
    return n


def _counts(v: str) -> list[int]:
    """An argparse type: a comma-separated list of ints >= 1 (`8,16,32,64`)."""
    try:
        out = [int(x) for x in v.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, got {v!r}")
    return out


def _doc_lengths(v: str) -> tuple[int, int] | None:
    """An argparse type: `even` (None: every document the same length) or `loguniform:LO:HI` (each document's length
    drawn log-uniformly in [LO, HI] tokens, then all scaled together to fill the request)."""
    if v == "even":
        return None
    kind, _, rest = v.partition(":")
    lo, _, hi = rest.partition(":")
    if kind != "loguniform" or not (lo.isdigit() and hi.isdigit()) or not 128 <= int(lo) <= int(hi):
        raise argparse.ArgumentTypeError(f"must be 'even' or 'loguniform:LO:HI' with 128 <= LO <= HI, got {v!r}")
    return int(lo), int(hi)


def add_model_args(ap: argparse.ArgumentParser, lengths: str, many_docs: bool = False) -> None:
    """The flags bench/ttft.py and bench/ttft_tp.py share: the request, the model's size, the profile, reps.
    With `many_docs`, --docs takes a list of document counts (each length is measured at each count)."""
    ap.add_argument("--lengths", default=lengths)
    ap.add_argument("--experts", type=int, default=16, help="routed experts kept (Flash has 256)")
    ap.add_argument("--layers", type=int, default=43)
    if many_docs:
        ap.add_argument("--docs", type=_counts, default=[8], help="document counts, e.g. 8,16,32,64")
    else:
        ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-lengths", type=_doc_lengths, default=None, metavar="even|loguniform:LO:HI",
                    help="the documents' lengths: all the same (even, the default) or drawn per document from a "
                         "log-uniform distribution on [LO, HI] tokens and scaled together to fill the length")
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--global-picks", default=None, choices=["online", "artifact"],
                    help="the Global rows' CSA picks: the indexer's over every segment (online) or each row's own "
                         "document's, stored (artifact) (default: the Flash preset's, online: what is served)")
    ap.add_argument("--local-format", default=None, choices=["native", "fp8"],
                    help="the stored Local contribution: the model's dtype, or e4m3 with row-block scales "
                         "(default: the Flash preset's, fp8)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=_at_least_one, default=2,
                    help="untimed runs of every arm before the timed reps (each one's time is printed and kept); the "
                         "first compiles, and a process's second reuse run can be slow at 16K "
                         "(docs/BENCHMARKS.md run 19)")
    ap.add_argument("--q-chunk", type=int, default=4096)
    ap.add_argument("--small", action="store_true", help="tiny dims for a CPU smoke run (not a measurement)")


def model_config(args):
    """(ModelConfig, ReuseProfile) of the benchmark from add_model_args' flags."""
    cfg = FLASH.replace(n_routed_experts=args.experts, n_layers=args.layers,
                        compress_ratios=FLASH.compress_ratios[:args.layers])
    if args.small:
        cfg = cfg.replace(dim=256, n_heads=16, head_dim=128, rope_head_dim=32, q_lora_rank=128, o_lora_rank=128,
                          index_n_heads=8, index_head_dim=32, index_topk=64, moe_inter_dim=128, vocab_size=1024)
    return cfg, FLASH_PROFILE.replace(budget=args.budget, global_picks=args.global_picks or FLASH_PROFILE.global_picks,
                                      local_format=args.local_format or FLASH_PROFILE.local_format)


def flash_model(cfg, device: torch.device, q_chunk: int) -> Transformer:
    """The benchmarks' model on `device`: bf16 on CUDA (the serving dtype), float32 elsewhere, random weights drawn
    from seed 0, in eval mode."""
    with torch.device(device):
        model = Transformer(cfg, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, q_chunk=q_chunk)
    init_random(model, 0, per_name=False)
    return model.eval()


def timed(fn, device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1000, out
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def doc_lengths(L: int, n_docs: int, spread: tuple[int, int] | None, seed: int) -> list[int]:
    """Each document's length in whole 128-token blocks, together at most L: all the same (`spread` None), or drawn
    log-uniformly on `spread` = (LO, HI) from `seed` and scaled together to fill L (so the shape of the draw, not
    its sum, is what varies; every document keeps at least one block)."""
    blocks = L // 128
    if blocks < n_docs:
        raise SystemExit(f"length {L} leaves {n_docs} documents under 128 tokens each (documents are whole "
                         f"128-token blocks): use a length of at least {128 * n_docs} or fewer --docs")
    if spread is None:
        return [blocks // n_docs * 128] * n_docs
    g = torch.Generator().manual_seed(seed)
    lo, hi = spread
    draw = torch.exp(torch.empty(n_docs, dtype=torch.float64).uniform_(math.log(lo), math.log(hi), generator=g))
    x = draw / draw.sum() * (blocks - n_docs)            # >= 1 block each, then the rest by largest remainder
    share = x.floor().long() + 1
    share[torch.argsort(x - x.floor(), descending=True)[:blocks - int(share.sum())]] += 1
    return [int(n) * 128 for n in share]


def request(cfg, L: int, n_docs: int, n_q: int, seed: int, spread: tuple[int, int] | None = None):
    """Documents of random token ids filling L (the question comes on top), and the question."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist()
            for n in doc_lengths(L, n_docs, spread, seed)]
    return docs, torch.randint(2, cfg.vocab_size, (n_q,), generator=g).tolist()


def artifact_bytes(cfg, prof, lengths: list[int], elem: int, whole: bool = False) -> dict[str, int]:
    """Bytes of the hot artifacts of one request (documents of `lengths` tokens), by kind, as the producer writes
    them (the prefix document's Local contribution and picks are dropped: its rows are never computed); `whole`:
    every document complete, as the store keeps it (any of them may open a request)."""
    b = dict(latent=0, entries=0, index_keys=0, picks=0, local=0)
    C = cfg.o_groups * cfg.o_lora_rank
    row = C + -(-C // FP8_ROW_BLOCK) if prof.local_format == "fp8" else C * elem
    for i in range(cfg.n_layers):
        r, kind, reusable = cfg.compress_ratios[i], cfg.layer_kind(i), not prof.is_fence(cfg, i)
        for j, n in enumerate(lengths):
            b["latent"] += n * cfg.head_dim * elem
            if r:
                b["entries"] += (n // r) * cfg.head_dim * elem
            if kind == CSA:
                b["index_keys"] += (n // 4) * cfg.index_head_dim * elem
                if reusable and prof.global_picks == "artifact" and (j or whole):
                    b["picks"] += n * min(cfg.index_topk, n // 4) * 4
            if reusable and (j or whole):   # W_a,L O_L: o_groups x o_lora_rank per row (FP8: a byte and a scale/128)
                b["local"] += n * row
    return b


def drop_unused(doc: DocumentArtifact) -> DocumentArtifact:
    """The prefix document: its rows are never computed, so its Local contribution and picks are not kept."""
    return DocumentArtifact(doc.tokens, doc.n_content,
                            [dataclasses.replace(la, local_p=None, local_s=None, picks=None) for la in doc.layers],
                            doc.tp_rank, doc.tp_size, doc.meta)


def hot_artifacts(model, docs, prof) -> list[DocumentArtifact]:
    """The documents' artifacts in pinned host memory, one produced at a time; the prefix document's unused fields
    are dropped before pinning, so they take no host memory and every layer is staged with one copy per document."""
    return [pin(drop_unused(a) if j == 0 else a) for j, a in enumerate(produce(model, d, prof) for d in docs)]


def host_profile(fn, device, title: str, top: int = 40) -> str:
    """cProfile of one call of `fn` (the GPU drained first and after): the Python functions by their own time, the
    callers of Triton's launch (`kernel[grid](...)`) and the functions by their time with callees. Where the GPU waits on launches this is the reuse arm's critical path."""
    import cProfile
    import io
    import pstats
    if device.type == "cuda":
        torch.cuda.synchronize()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    pr.disable()
    wall = time.perf_counter() - t0
    out = io.StringIO()
    out.write(f"## host profile {title}: {wall * 1e3:.1f} ms under cProfile\n")
    st = pstats.Stats(pr, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.print_callers(r"triton/runtime/jit.py:\d+\(<lambda>\)")        # who launches Triton kernels, how often
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def release_pinned() -> None:
    """Pinned blocks freed by a finished length go back to the OS (the caching host allocator keeps them, and the
    next length's blocks have other sizes)."""
    gc.collect()
    if torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


def plot(rows: list[dict], name: str, out: str, cold_rows: tuple[str, list[dict]] | None = None) -> None:
    """TTFT per arm against request tokens (log-log): recompute, the hot reuse arm per budget, the cold arm (from
    `rows`, or only from `cold_rows` = (its source's name, rows) when given: a cold arm measured in another run).
    Needs matplotlib (`pip install -e .[bench]`); without it the JSON is still written and the plot can be drawn
    later with --plot-from."""
    try:
        import matplotlib
    except ImportError:
        print(f"## no plot: matplotlib is not installed (pip install -e .[bench]); draw it later with "
              f"python bench/ttft.py --plot-from RUN.json ... --plot {out}", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.figure(figsize=(6.4, 4.4))
    rec = sorted({(r["tokens"], r["recompute_s"]) for r in rows})
    plt.plot([p[0] for p in rec], [p[1] for p in rec], "o-", label="recompute arm")
    arms: dict[float, list] = {}
    for r in rows:
        arms.setdefault(r.get("budget", 0.25), []).append((r["tokens"], r["reuse_s"]))
        for e in r.get("extra", []):
            arms.setdefault(e["budget"], []).append((r["tokens"], e["reuse_s"]))
    for (b, pts), mark in zip(sorted(arms.items(), reverse=True), "sdv<>"):
        pts.sort()
        plt.plot([p[0] for p in pts], [p[1] for p in pts], mark + "-", label=f"reuse arm, hot, budget {b:.0%}")
    source, cold = ("", rows) if cold_rows is None else (f", {cold_rows[0]}", cold_rows[1])
    for r in cold:
        if "cold_s" in r:
            plt.plot([r["tokens"]], [r["cold_s"]], "^", color="tab:red",
                     label=f"reuse arm, cold (artifacts built), {r['tokens'] // 1024}K{source}")
    plt.xscale("log", base=2)
    plt.yscale("log")
    plt.xlabel("request tokens")
    plt.ylabel("TTFT (s)")
    plt.title(f"{name}: TTFT per arm")
    plt.legend(fontsize=8)
    plt.grid(alpha=0.3)
    plt.tight_layout()
    plt.savefig(out, dpi=120)


def recompute(model, full: torch.Tensor) -> torch.Tensor:
    """The recompute arm: one forward over the whole request, or, under a policy `prefill_chunk`, the worker's
    chunked prefill into a fresh cache."""
    return model.prefill(full, model.new_cache()) if model.policy.prefill_chunk else model(full)


def main() -> int:
    if "--plot-from" in sys.argv:            # no run: one plot from the --json files of earlier runs
        pp = argparse.ArgumentParser()
        pp.add_argument("--plot-from", nargs="+", required=True)
        pp.add_argument("--plot", required=True)
        pp.add_argument("--cold-from", default=None,
                        help="take the cold arm only from this run's --json (the --plot-from runs' own are left out)")
        pa = pp.parse_args()
        runs = [json.load(open(f)) for f in pa.plot_from]
        cold = None
        if pa.cold_from:
            cold = (os.path.splitext(os.path.basename(pa.cold_from))[0], json.load(open(pa.cold_from))["rows"])
        plot([r for run in runs for r in run["rows"]], runs[0]["device"], pa.plot, cold)
        return 0
    tp = argparse.ArgumentParser(add_help=False)
    tp.add_argument("--tp", type=int, default=1)
    if tp.parse_known_args()[0].tp > 1:       # tensor parallel over NCCL: bench/ttft_tp.py (same flags, plus store)
        from bench.ttft_tp import main as tp_main
        return tp_main()
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1, help="> 1: one process per GPU over NCCL (bench/ttft_tp.py)")
    add_model_args(ap, lengths="16384,32768,65536,131072", many_docs=True)
    ap.add_argument("--cold-at", type=int, default=65536)
    ap.add_argument("--profile-at", type=int, default=0, help="print a torch.profiler table of both arms at this length")
    ap.add_argument("--profile-stack", action="store_true",
                    help="record Python stacks in the profile, so the GPU-idle reading names our functions")
    ap.add_argument("--syncs-at", type=int, default=0,
                    help="at this length, print every host sync of one reuse prefill with our code that made it, and "
                         "the caching allocator's synchronizations (bench/syncs.py)")
    ap.add_argument("--hostprof-at", type=int, default=0,
                    help="cProfile one reuse prefill at this length (after the timed reps): where the host's time goes "
                         "where the GPU waits on launches")
    ap.add_argument("--check-at", type=int, default=0,
                    help="at this length, compare first-token logits of the kernel path against the reference path")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--host-budget-gib", type=float, default=100.0,
                    help="pinned host memory the hot artifacts may take; a length needing more is skipped")
    ap.add_argument("--extra-budgets", default="",
                    help="comma list: also time the reuse arm at these budgets, on the same artifacts and tokens, "
                         "interleaved with the arms above (the artifacts do not depend on the budget)")
    ap.add_argument("--policy", action="append", default=[], metavar="KEY=VALUE",
                    help="also time the reuse arm at --budget under the default RuntimePolicy with this field changed "
                         "(repeatable: runtime/policy.py names the fields, e.g. fused_min_heads=8, "
                         "moe_grouped_slots=0) beside the default's, interleaved; the row gets policy_s, policy_all "
                         "and the changed fields")
    ap.add_argument("--prefill-chunk", type=int, default=0, metavar="N",
                    help="the recompute arm's forward in chunks of N tokens into a cache (the policy's prefill_chunk, "
                         "as the worker's recompute arm runs under it: the same logits, bounded activations; 0: one "
                         "forward without a cache)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    if args.prefill_chunk < 0:
        ap.error("--prefill-chunk must be >= 0")
    try:
        alt = RuntimePolicy.parse(args.policy) if args.policy else None
    except ValueError as e:
        ap.error(str(e))
    extra = [float(v) for v in args.extra_budgets.split(",") if v.strip()]
    if any(not 0 < b <= 1 for b in extra):
        ap.error(f"--extra-budgets must lie in (0, 1], got {args.extra_budgets!r}")
    device = torch.device(args.device)
    cfg, prof = model_config(args)
    model = flash_model(cfg, device, args.q_chunk)
    if args.prefill_chunk:
        model.set_policy(model.policy.replace(prefill_chunk=args.prefill_chunk))
    dtype = model.dtype
    name = header(f"Flash dims x {cfg.n_layers} layers, {dtype}, routed experts {args.experts} of 256 (top-6 + shared "
                  f"kept) | profile {prof.first_fences}F-{len(prof.reusable_layers(cfg))}R-{prof.last_fences}F, budget "
                  f"{prof.budget:.0%}, global_picks={prof.global_picks} | {','.join(map(str, args.docs))} documents ("
                  f"{'even lengths' if args.doc_lengths is None else 'lengths log-uniform on %d..%d' % args.doc_lengths}"
                  f") + {args.question}-token question", device)["device"]
    rows = []
    record = dict(experts=args.experts, layers=cfg.n_layers, profile=prof.to_dict(), rows=rows)   # rows as they come
    lengths = [int(v) for v in args.lengths.split(",")]
    elem = torch.empty((), dtype=dtype).element_size()
    for L, n_docs in itertools.product(lengths, args.docs):
        docs, question = request(cfg, L, n_docs, args.question, seed=L, spread=args.doc_lengths)
        per_doc = [len(d) for d in docs]
        need = artifact_bytes(cfg, prof, per_doc, elem)
        total = sum(need.values())
        copies = 2 if L == args.cold_at else 1         # the cold arm builds a second copy beside the hot one
        n_r = max(1, len(prof.reusable_layers(cfg)))
        print(f"## {L} tokens, {n_docs} documents of {min(per_doc)}..{max(per_doc)} tokens: hot artifacts {total / 2**30:.1f} GiB in pinned host memory ("
              + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in need.items())
              + f" GiB; Local W_a,L O_L = {cfg.o_groups} x {cfg.o_lora_rank} x "
              + ("1 B + a scale per 128" if prof.local_format == "fp8" else f"{elem} B") + " per relocated row and "
              f"reusable layer, {need['local'] / n_r / 2**30:.2f} GiB per layer x {n_r}); staged per reusable layer "
              f"{(total - need['latent'] * (cfg.n_layers - n_r) / cfg.n_layers) / n_r / 2**30:.2f} GiB; host memory "
              f"{host_memory() / 2**30:.0f} GiB, budget {args.host_budget_gib:.0f} GiB"
              + (", x2 with the cold arm" if copies == 2 else ""), flush=True)
        if copies * total > args.host_budget_gib * 2**30:
            print(f"## {L} tokens skipped: {copies * total / 2**30:.1f} GiB of pinned artifacts exceed the host budget "
                  f"(nothing is kept on the GPU instead: the GPU holds the model and the recompute arm's activations)",
                  flush=True)
            continue
        t_build = time.perf_counter()
        arts = hot_artifacts(model, docs, prof)
        t_build = time.perf_counter() - t_build
        full = torch.tensor([t for a in arts for t in a.tokens] + question, device=device)
        engine = ReuseEngine(model, prof)
        others = {b: ReuseEngine(model, prof.replace(budget=b)) for b in extra}

        loose = []                       # per reuse run: (layer, document) pairs staged tensor by tensor

        def reuse(eng=engine):
            pf = LayerPrefetcher(arts, device)
            out = eng.prefill(pf.documents(), question)
            loose.append(pf.loose)
            return out

        def reuse_alt():                 # the reuse arm under the alternative policy, then the default again
            with model.policy_as(alt):
                return reuse()

        rec_t, reu_t, alloc = [], [], []
        other_t, other_res = {b: [] for b in extra}, {}
        mem, warm = {}, {"recompute": [], "reuse": []}           # warm-up, every arm
        for _ in range(args.warmup):
            for arm, fn in (("recompute", lambda: recompute(model, full)), ("reuse", reuse)):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t, res = timed(fn, device)
                warm[arm].append(t)
                if device.type == "cuda":
                    m = dict(peak_allocated=torch.cuda.max_memory_allocated(),
                             peak_reserved=torch.cuda.max_memory_reserved())
                    mem[arm] = {k: max(v, mem.get(arm, {}).get(k, 0)) for k, v in m.items()}
        print(f"## {L} tokens, warm-up runs: " + "; ".join(
            f"{arm} " + " / ".join(f"{t:.3f}" for t in ts) + " s" for arm, ts in warm.items()), flush=True)
        if mem:
            gpu = torch.cuda.get_device_properties(device).total_memory
            print(f"## {L} tokens, warm-up: " + "; ".join(
                f"{arm} peak allocated {m['peak_allocated'] / 2**30:.1f} GiB, reserved {m['peak_reserved'] / 2**30:.1f}"
                f" GiB" for arm, m in mem.items()) + f" (GPU {gpu / 2**30:.1f} GiB)", flush=True)
        for b, eng in others.items():
            timed(lambda: reuse(eng), device)
        alt_t = []
        if alt is not None:
            timed(reuse_alt, device)
        for _ in range(args.reps):                               # interleaved, side by side
            rec_t.append(timed(lambda: recompute(model, full), device)[0])
            before = allocator_counters()
            t, res = timed(reuse, device)
            alloc.append(allocator_delta(before))
            reu_t.append(t)
            if alt is not None:
                alt_t.append(timed(reuse_alt, device)[0])
            for b, eng in others.items():
                t, other_res[b] = timed(lambda: reuse(eng), device)
                other_t[b].append(t)
        led = res.ledger.summary()
        # the reuse arm really reused: rows were restored and heads skipped, no silent recomputation
        assert 0 < led["rows"]["active"] < led["rows"]["relocated"] and led["head_row_saving"] > 0, led
        rec, reu = statistics.median(rec_t), statistics.median(reu_t)
        row = dict(tokens=int(full.numel()), docs=n_docs, doc_lengths=per_doc, budget=prof.budget, recompute_s=rec, reuse_s=reu, speedup=rec / reu,
                   flop_ratio=led["flop_saving"]["ratio"], head_row_saving=led["head_row_saving"],
                   structural_ceiling=led["structural_ceiling"], token_row_saving=led["token_row_saving"],
                   flop_saving=led["flop_saving"], build_s=t_build, active=led["rows"]["active"],
                   relocated=led["rows"]["relocated"], recompute_all=rec_t, reuse_all=reu_t, extra=[],
                   staged_loose=max(loose, default=0),
                   allocator=max(alloc, key=lambda d: d["num_sync_all_streams"], default={}), warmup_memory=mem,
                   warmup_s=warm)
        if row["allocator"].get("num_sync_all_streams") or row["allocator"].get("num_alloc_retries"):
            print(f"## {L} tokens: the caching allocator synchronized during a reuse run: {row['allocator']}",
                  flush=True)
        if row["staged_loose"]:
            print(f"## {L} tokens: {row['staged_loose']} (layer, document) pairs were staged tensor by tensor, "
                  f"not with one copy (not packed by pin)", flush=True)
        if alt is not None:
            row.update(policy=alt.diff(), policy_s=statistics.median(alt_t), policy_all=alt_t)
        for b in extra:
            lb = other_res[b].ledger.summary()
            assert 0 < lb["rows"]["active"] < lb["rows"]["relocated"] and lb["head_row_saving"] > 0, lb
            rb = statistics.median(other_t[b])
            row["extra"].append(dict(budget=b, reuse_s=rb, speedup=rec / rb, flop_ratio=lb["flop_saving"]["ratio"],
                                     head_row_saving=lb["head_row_saving"], token_row_saving=lb["token_row_saving"],
                                     flop_saving=lb["flop_saving"], active=lb["rows"]["active"],
                                     relocated=lb["rows"]["relocated"], reuse_all=other_t[b]))
        if L == args.check_at and device.type == "cuda":
            got = {}
            for flag in ("1", "0"):
                os.environ["REDKNOT_KERNELS"] = flag
                got[flag] = (recompute(model, full).float(), reuse().logits.float())
            os.environ["REDKNOT_KERNELS"] = "1"
            for k, arm in enumerate(("recompute", "reuse")):
                a, b = got["1"][k], got["0"][k]
                print(f"## check at {L}: {arm} arm, kernels vs reference path: rel err "
                      f"{((a - b).norm() / b.norm()).item():.2e}, same argmax {int(a.argmax()) == int(b.argmax())}")
        if L == args.syncs_at and device.type == "cuda":
            print(sync_report(reuse, title=f"of one reuse prefill at {L}"), flush=True)
        if L == args.hostprof_at:
            print(host_profile(reuse, device, title=f"of one reuse prefill at {L}"), flush=True)
        if L == args.profile_at and device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile
            for arm, fn in (("reuse", reuse), ("recompute", lambda: recompute(model, full))):
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                             with_stack=args.profile_stack) as prof_:
                    fn()
                    torch.cuda.synchronize()
                print(f"## profile of the {arm} arm at {L}")
                avg = prof_.key_averages()
                print(avg.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60))
                dev_t = (lambda e: e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
                print(f"## {arm} arm at {L}: phases (labels in runtime/reuse/deepseek.py and Block.forward; nested "
                      f"labels count inside their parents), CUDA time of the kernels each launched")
                for e in sorted((e for e in avg if e.key.startswith(("rk.", "blk."))), key=lambda e: -dev_t(e)):
                    print(f"   {e.key:16s} calls {e.count:6d}  CUDA {dev_t(e) / 1e3:9.1f} ms  "
                          f"host {e.cpu_time_total / 1e3:9.1f} ms")
                kernels = sum(e.count for e in avg if e.device_type == torch.autograd.DeviceType.CUDA)
                syncs = sum(e.count for e in avg if e.key in ("aten::_local_scalar_dense", "aten::nonzero"))
                print(f"## {arm} arm at {L}: {kernels} CUDA kernels and memcpys, {syncs} host syncs "
                      f"(_local_scalar_dense + nonzero)")
                from bench.gaps import report
                with tempfile.TemporaryDirectory() as tmp:
                    prof_.export_chrome_trace(os.path.join(tmp, "trace.json"))
                    print(report(os.path.join(tmp, "trace.json"), title=f"of the {arm} arm at {L}"))
        if L == args.cold_at:
            def cold():
                fresh = hot_artifacts(model, docs, prof)
                return engine.prefill(LayerPrefetcher(fresh, device).documents(), question)
            row["cold_s"] = timed(cold, device)[0]
        rows.append(row)
        if len(rows) < len(lengths) * len(args.docs):     # what is done so far survives a run stopped by a time limit
            write_json(args.json, dict(record, partial=True), args, device, quiet=True)
        print(f"T={row['tokens']:7d} x {n_docs:2d} docs  recompute {rec:7.3f} s  reuse {reu:7.3f} s  speedup {rec / reu:5.2f}x  "
              f"(analytic FLOP ratio {row['flop_ratio']:.2f}x; head-row {row['head_row_saving']:.1%} of ceiling "
              f"{row['structural_ceiling']:.1%}; token-row {row['token_row_saving']:.1%}; active "
              f"{row['active']}/{row['relocated']})" + (f"  cold {row['cold_s']:.3f} s" if "cold_s" in row else "")
              + (f"  policy {' '.join(args.policy)}: reuse {row['policy_s']:.3f} s" if "policy_s" in row else ""),
              flush=True)
        for e in row["extra"]:
            print(f"T={row['tokens']:7d} x {n_docs:2d} docs  budget {e['budget']:.0%}: reuse {e['reuse_s']:7.3f} s  speedup "
                  f"{e['speedup']:5.2f}x  (analytic FLOP ratio {e['flop_ratio']:.2f}x; head-row "
                  f"{e['head_row_saving']:.1%}; token-row {e['token_row_saving']:.1%}; active "
                  f"{e['active']}/{e['relocated']})", flush=True)
        del arts, engine, others, res, other_res
        release_pinned()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            print(f"## {L} tokens: peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
            torch.cuda.reset_peak_memory_stats()
    write_json(args.json, record, args, device)
    if args.plot:
        plot(rows, name, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
