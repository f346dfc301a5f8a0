"""TTFT through the served path: HTTP request -> API -> worker -> store -> GPU, on one machine. Not a test.

The real stack as separate processes (services/common/stack.py): redis-server, `redknot store serve` (fs blobs and
its local socket), the API, the builder and a worker on the GPU. The model is a DeepSeek-V4-Flash-shaped random-init
checkpoint at real dimensions (routed experts reduced to fit, as in bench/ttft.py): config, tokenizer and a seed,
which every service draws identically (runtime/model/random_init.py; the spec is the checkpoint identity). Per
length, --docs documents of random token ids are uploaded through `POST /v1/documents` and built by the builder;
requests go through `POST /v1/generate` with one new token, so the response is the first token: the client's time
(request sent to response read) is the time to first token as a user sees it, beside the server's `ttft_s`.

Cases per length:
  cold       documents not yet built (--cold-at): the first upload sent to the first token of a reuse request
             issued as soon as every document is ready (build, store upload, the worker's fetch into its tier
             included); the builder and the worker then share the GPU, which at Flash size does not fit one H200
  recompute  the recompute arm over the same documents
  hot        the reuse arm with every document in the worker's pinned host tier
  empty      the reuse arm with the tier off (the worker restarted with --tier-gib 0): every byte fetched from the
             co-located store through its local socket, verified, staged group by group while the forward runs
Medians of --reps after --warmup untimed requests of each arm; a reuse case that fell back stops the run.

    python bench/serve_ttft.py --lengths 16384,32768 --budget 0.1 --json bench/results/serve.json   # on the GPU
    python bench/serve_ttft.py --small                                                          # CPU smoke run

Disk and memory: a bf16 document token with stored picks costs about 0.69 MB of artifacts over the 43 layers at
TP1 with the Local contribution native, 0.39 MB with it in FP8 (the flash preset's), stored once by the store (the
builder's copy is removed after upload) and held once more in the pinned tier. Before any service starts, the run
estimates what the store will hold (`check_disk`) and stops if it does not fit under --workdir: 128K with stored
picks is about 48 GiB, within the GPU machine's 64 GiB disk only on a fresh machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.ttft import add_model_args, artifact_bytes, doc_lengths, model_config, request  # noqa: E402
from runtime.model.checkpoint import build_demo_tokenizer, load_tokenizer  # noqa: E402
from runtime.model.random_init import write_random_checkpoint  # noqa: E402
from services.common.serving import serving_dtype  # noqa: E402
from services.common.stack import LocalStack, StackConfig  # noqa: E402
from bench.report import header, write_json  # noqa: E402

TENANT, TOKEN = "bench", "bench-token-0123456789abcdef0123"
QUESTION = ("Question: across every document above, which passage names the generation that becomes visible "
            "once the certificate is written last, and what does the log-sum-exp merge combine? Answer:")
BUILD_TIMEOUT_S = 3600.0


def random_checkpoint(args, cfg, prefix: str) -> tuple[Path, Path]:
    """The bench's work directory (--workdir, or a new temporary one) and in it the random-init checkpoint every
    service draws identically (the demo tokenizer beside it)."""
    work = Path(args.workdir or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    tok = work / "tokenizer.json"
    build_demo_tokenizer(1024, tok)
    ckpt = write_random_checkpoint(work / "checkpoint", cfg, seed=0, device="cuda" if args.device == "cuda" else "cpu",
                                   tokenizer_json=tok)
    return work, ckpt


def add_worker_args(ap) -> None:
    """The served worker's flags both serve benchmarks take (`worker_env` turns them into its settings)."""
    ap.add_argument("--prefill-chunk", type=int, default=0, metavar="N",
                    help="the worker's recompute arm in chunks of N tokens (REDKNOT_POLICY prefill_chunk=N: the same "
                         "logits, bounded activations at long context; 0: one forward)")


def worker_env(args) -> dict[str, str]:
    """The worker's environment in a serve benchmark: a request queue that may hold a long build's worth of
    requests, and the policy `add_worker_args` asked for."""
    return {"REDKNOT_WORKER_REQUEST_TIMEOUT_S": "1800",
            **({"REDKNOT_POLICY": f"prefill_chunk={args.prefill_chunk}"} if args.prefill_chunk else {})}


def check_disk(args, cfg, prof, sets: list[tuple[int, int]]) -> list[int]:
    """The bytes the store will hold for the document sets the run builds (`request`'s (length, seed) each), every
    document complete in the serving dtype, against the free space under --workdir (or the temporary folder
    `random_checkpoint` makes one in), before any service starts: a 128K
    set is about 48 GiB, and a disk that fills mid-build fails the run minutes in. The builder's copy of one
    document (removed after its upload) is the margin. Returns each set's estimate (the store held 0.02% more at 64K:
    its headers). The folder need not exist yet: its nearest existing parent is asked."""
    work = Path(args.workdir or tempfile.gettempdir())
    elem = torch.empty((), dtype=serving_dtype("auto", args.device)).element_size()
    docs = [artifact_bytes(cfg, prof, doc_lengths(L, args.docs, args.doc_lengths, seed), elem, whole=True)
            for L, seed in sets]
    per_set = [sum(b.values()) for b in docs]
    need, margin = sum(per_set), max(per_set) // args.docs
    there = work
    while not there.exists():
        there = there.parent
    free = shutil.disk_usage(there).free
    if need + margin > free:
        raise SystemExit(f"the documents of this run need {need / 2**30:.1f} GiB in the store under {work} "
                         f"(+{margin / 2**30:.1f} GiB while a document is built) and {free / 2**30:.1f} GiB are "
                         "free: use --workdir on a larger disk, fewer or shorter --lengths, or --local-format fp8")
    return per_set


def _client(stack: LocalStack) -> httpx.Client:
    return httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {TOKEN}"},
                        timeout=httpx.Timeout(1800.0, connect=10.0))


def upload(c: httpx.Client, docs: list[list[int]]) -> list[str]:
    ids = []
    for toks in docs:
        r = c.post("/v1/documents", json={"tokens": toks})
        r.raise_for_status()
        ids.append(r.json()["id"])
    return ids


def wait_ready(c: httpx.Client, ids: list[str]) -> None:
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while True:
        recs = []
        for i in ids:
            r = c.get(f"/v1/documents/{i}")
            if r.status_code != 200:
                raise SystemExit(f"GET /v1/documents/{i}: {r.status_code} {r.text[:500]}")
            recs.append(r.json())
        bad = [r for r in recs if r["status"] == "failed"]
        if bad:
            raise SystemExit(f"build failed: {bad[0]['error']}")
        if all(r["status"] == "ready" for r in recs):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"documents not ready after {BUILD_TIMEOUT_S:.0f} s: {[r['stage'] for r in recs]}")
        time.sleep(0.2)


def generate(c: httpx.Client, ids: list[str], arm: str) -> dict:
    """One request with one new token; the client's seconds from sending it to reading the response."""
    t = time.perf_counter()
    r = c.post("/v1/generate", json={"documents": ids, "question": QUESTION, "max_new_tokens": 1, "arm": arm})
    client_s = time.perf_counter() - t
    r.raise_for_status()
    out = r.json()
    if arm == "reuse" and (out["arm"] != "reuse" or out["fallback"] is not None):
        raise SystemExit(f"the reuse arm fell back: {out['fallback']}")
    return dict(client_s=client_s, server_ttft_s=out["ttft_s"], fetch_s=out["fetch_s"], arm=out["arm"],
                token=out["tokens"][0], ledger=out["ledger"])


def summarize(runs: list[dict]) -> dict:
    return dict(client_s=statistics.median(r["client_s"] for r in runs),
                server_ttft_s=statistics.median(r["server_ttft_s"] for r in runs),
                fetch_s=statistics.median(r["fetch_s"] for r in runs),
                reps_client_s=[round(r["client_s"], 4) for r in runs])


def worker_metric(stack: LocalStack, prefix: str) -> float:
    text = httpx.get(stack.worker_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap, lengths="16384,32768")
    ap.set_defaults(budget=0.1)
    ap.add_argument("--cold-at", default="", help="lengths that also time the cold case (comma list; empty: none); "
                                                  "the builder and the worker then share the GPU, which at Flash "
                                                  "size does not fit one H200")
    ap.add_argument("--empty-at", default="", help="lengths that time the tier-empty case (comma list; default: "
                                                   "every length)")
    ap.add_argument("--empty-reps", type=int, default=0, help="reps of the tier-empty case (default: --reps)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tier-gib", type=float, default=100.0, help="the worker's pinned tier per rank (hot case)")
    add_worker_args(ap)
    ap.add_argument("--workdir", default="", help="keep the stack's files here (default: a temp dir)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.small:
        args.lengths, args.cold_at, args.docs, args.reps, args.warmup = "512", "512", 2, 2, 1
        args.device, args.tier_gib, args.layers, args.experts = "cpu", 1.0, 8, 8
    lengths = [int(v) for v in args.lengths.split(",") if v.strip()]
    cold_at = {int(v) for v in args.cold_at.split(",") if v.strip()}
    empty_at = [L for L in lengths if not args.empty_at.strip() or L in {int(v) for v in args.empty_at.split(",")}]
    empty_reps = args.empty_reps or args.reps
    cfg, prof = model_config(args)
    cold = sorted(cold_at & set(lengths))
    estimate = check_disk(args, cfg, prof, [(L, L) for L in lengths] + [(L, L + 1) for L in cold])
    work, ckpt = random_checkpoint(args, cfg, "rk-serve-")
    tok = work / "tokenizer.json"
    n_q = len(load_tokenizer(tok).encode(QUESTION).ids)
    header(f"Flash dims x {cfg.n_layers} layers{' (small)' if args.small else ''}"
           f", routed experts {cfg.n_routed_experts} | profile {prof.first_fences}F-{prof.last_fences}F budget "
           f"{prof.budget} picks {prof.global_picks} Local {prof.local_format}"
           f" | {args.docs} documents + a {n_q}-token question | served: API -> worker -> store", args.device)
    stack = LocalStack(StackConfig(
        workdir=work / "stack", model=ckpt, tp=1, profile=json.dumps(prof.to_dict()), device=args.device,
        tenants={TENANT: TOKEN}, tier_gib=args.tier_gib,
        # the worker's request queue may hold a long build's worth of requests; one API call may take minutes
        worker_env=worker_env(args), api_env={"REDKNOT_API_GENERATE_TIMEOUT_S": "1800"}))
    t = time.perf_counter()
    # builds first, with no worker: one GPU holds one Flash-sized model and its work at a time (two models and a
    # builder's forward beside them ran out of the H200's memory); in a deployment builders have GPUs of their own.
    # The cold case needs both at once: the worker starts before it, the builder stays.
    stack.start(progress=lambda n: print(f"  {n} ready ({time.perf_counter() - t:.0f} s)", flush=True),
                defer=("worker",))
    rows: dict[int, dict] = {}
    builder_code = None
    try:
        with _client(stack) as c:
            for L in lengths:
                docs, _ = request(cfg, L, args.docs, 1, seed=L, spread=args.doc_lengths)
                row = rows[L] = dict(length=L, tokens=sum(map(len, docs)) + n_q, docs=args.docs)
                row["ids"] = upload(c, docs)
                wait_ready(c, row["ids"])
                row["store_bytes"] = sum(c.get(f"/v1/documents/{i}").json()["bytes"] for i in row["ids"])
                row["store_bytes_estimate"] = estimate[lengths.index(L)]
                print(f"  {L}: {args.docs} documents built ({row['store_bytes'] / 2**30:.1f} GiB stored)", flush=True)
            if not cold:
                builder_code = stack.services["builder"].stop()
            stack.restart("worker")
            generate(c, rows[lengths[0]]["ids"], "reuse")   # compiles the worker's kernels, fills the tier
            for L in cold:
                fresh, _ = request(cfg, L, args.docs, 1, seed=L + 1, spread=args.doc_lengths)
                t0 = time.perf_counter()
                cids = upload(c, fresh)
                wait_ready(c, cids)
                built = time.perf_counter() - t0
                one = generate(c, cids, "reuse")
                rows[L]["cold"] = dict(client_s=time.perf_counter() - t0, build_s=built, first_request_s=one["client_s"])
                print(f"  {L}: cold {rows[L]['cold']['client_s']:.1f} s (built in {built:.1f} s)", flush=True)
            if cold:
                builder_code = stack.services["builder"].stop()
            for L in lengths:
                row = rows[L]
                for arm in ("recompute", "reuse"):       # the first reuse request fills the tier
                    row.setdefault("warmup_s", {})[arm] = [round(generate(c, row["ids"], arm)["client_s"], 3)
                                                           for _ in range(args.warmup)]
                reps = {"recompute": [], "hot": []}
                for _ in range(args.reps):                # interleaved
                    reps["recompute"].append(generate(c, row["ids"], "recompute"))
                    reps["hot"].append(generate(c, row["ids"], "reuse"))
                row["recompute"], row["hot"] = summarize(reps["recompute"]), summarize(reps["hot"])
                row["ledger"] = reps["hot"][-1]["ledger"]
                print(f"  {L}: recompute {row['recompute']['client_s']:.3f} s (server {row['recompute']['server_ttft_s']:.3f})"
                      f", hot {row['hot']['client_s']:.3f} s (server {row['hot']['server_ttft_s']:.3f}): "
                      f"{row['recompute']['client_s'] / row['hot']['client_s']:.2f}x", flush=True)
            row0 = rows[lengths[0]]
            tier_bytes = worker_metric(stack, "redknot_tier_bytes{")
            # the tier off: every request fetches its documents from the co-located store
            stack.restart("worker", env={"REDKNOT_WORKER_TIER_GIB": "0"})
            for L in empty_at:
                row = rows[L]
                generate(c, row["ids"], "reuse")          # one warm-up: the restarted worker compiles again
                row["empty"] = summarize([generate(c, row["ids"], "reuse") for _ in range(empty_reps)])
                print(f"  {L}: tier empty {row['empty']['client_s']:.3f} s (fetch {row['empty']['fetch_s']:.3f})",
                      flush=True)
            assert worker_metric(stack, "redknot_tier_bytes{") == 0, "the tier-off worker kept documents"
            # the share of the tier-empty fetches read straight into slabs (the local socket's path) rather than
            # streamed as bytes
            fetched = worker_metric(stack, "redknot_artifact_fetch_bytes_total")
            placed = worker_metric(stack, "redknot_artifact_fetch_placed_bytes_total") / fetched if fetched else 0.0
            fallbacks = worker_metric(stack, "redknot_fallbacks_total{")
    finally:
        codes = stack.stop()
        if not args.workdir:        # a temporary stack's blobs (tens of GiB at 64K) would fill the disk run by run
            shutil.rmtree(work, ignore_errors=True)
        if builder_code is not None:        # stopped on purpose before the timed cases
            codes["builder"] = builder_code
    print("\n| tokens | docs | recompute s | reuse, tier hot s | speedup | reuse, tier empty s | speedup | "
          "cold s | server hot ttft s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for L, r in rows.items():
        rec, hot = r["recompute"]["client_s"], r["hot"]["client_s"]
        r["speedup_hot"] = rec / hot
        emp = f"{r['empty']['client_s']:.3f} | {rec / r['empty']['client_s']:.2f}x" if "empty" in r else "- | -"
        if "empty" in r:
            r["speedup_empty"] = rec / r["empty"]["client_s"]
        cold = f"{r['cold']['client_s']:.2f}" if "cold" in r else "-"
        print(f"| {r['tokens']} | {r['docs']} | {rec:.3f} | {hot:.3f} | {rec / hot:.2f}x | {emp} | {cold} | "
              f"{r['hot']['server_ttft_s']:.3f} |")
    print(f"# tier bytes while hot: {tier_bytes / 2**30:.2f} GiB; tier empty: {placed:.1%} of the fetched bytes read "
          f"straight into slabs; fallbacks counted after the restart: {fallbacks:.0f};"
          f" service exit codes {codes}")
    for r in rows.values():
        r.pop("ids", None)
    write_json(args.json, dict(small=args.small, layers=cfg.n_layers, experts=cfg.n_routed_experts,
                               budget=prof.budget, profile=prof.to_dict(), question_tokens=n_q, tier_bytes=tier_bytes,
                               empty_placed_share=placed,
                               first_length_store_bytes=row0["store_bytes"], rows=list(rows.values()),
                               exit_codes=codes), args, args.device)
    return 0 if all(v == 0 for v in codes.values()) and fallbacks == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
