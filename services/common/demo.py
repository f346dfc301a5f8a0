"""`redknot demo` (`make demo`): the whole service on this machine, driven through its public HTTP API.

Starts the embedded default (a redis-server of its own unless REDIS_URL or --redis-url names one, the store on
filesystem blobs, the API, the builder and a TP worker over gloo), uploads the bundled documents, follows their
builds with a progress bar, runs requests in the recompute and the reuse arm, prints TTFT per arm, the four
savings namespaces and the fallbacks, keeps every /metrics endpoint up while it runs (and `--hold` seconds
after), then stops every service and reports how each exited."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import statistics
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from runtime.demo import ensure_checkpoint
from runtime.reuse_demo import DOCS

from .stack import LocalStack, StackConfig

QUESTIONS = ["Question: what makes a generation visible? Answer:",
             "Question: what is merged by a log-sum-exp? Answer:",
             "Question: which layers are always recomputed? Answer:"]
BUILD_TIMEOUT_S = 900.0


def _fallbacks(worker_metrics: str) -> dict[str, float]:
    out = {}
    for line in worker_metrics.splitlines():
        if line.startswith("redknot_fallbacks_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def _build(console: Console, api: httpx.Client, docs: list[str]) -> list[dict]:
    ids = []
    for text in docs:
        r = api.post("/v1/documents", json={"text": text})
        r.raise_for_status()
        ids.append(r.json()["id"])
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    with Progress(TextColumn("[bold]building artifacts"), BarColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("", total=len(ids))
        while True:
            recs = [api.get(f"/v1/documents/{i}").json() for i in ids]
            done = sum(r["status"] in ("ready", "failed") for r in recs)
            bar.update(task, completed=sum(1.0 if r["status"] in ("ready", "failed") else r["progress"]
                                           for r in recs),
                       description=f"{done}/{len(ids)} ready; " + ", ".join(sorted({r['stage'] for r in recs})))
            if done == len(ids):
                return recs
            if time.monotonic() > deadline:
                raise TimeoutError(f"documents not built after {BUILD_TIMEOUT_S:.0f}s: {recs}")
            time.sleep(0.2)


def run_service_demo(args) -> int:
    console = Console()
    workdir = Path(args.workdir).resolve()
    model = Path(args.model) if args.model else ensure_checkpoint(workdir, console)
    profile = args.profile or ("demo" if not args.model else "flash")
    run = workdir / "run"
    shutil.rmtree(run, ignore_errors=True)         # a fresh store, tier and logs every time
    redis_url = args.redis_url or os.environ.get("REDIS_URL", "")
    cfg = StackConfig(workdir=run, model=model, tp=args.tp, profile=profile, device=args.device, redis_url=redis_url,
                      prefix=f"redknot-demo-{secrets.token_hex(4)}")
    stack = LocalStack(cfg)
    token = cfg.tenants["demo"]

    def terminate(signum, _frame):             # SIGTERM: unwind through `finally`, so every service is stopped
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    t_start = time.perf_counter()
    with console.status("starting redis, store, API, builder and worker") as status:
        stack.start(progress=lambda name: status.update(f"started {name}; starting the rest"))
    console.print(f"services up in {time.perf_counter() - t_start:.1f}s (logs: {run / 'logs'})")
    for name, target in stack.metrics_targets().items():
        console.print(f"  /metrics of {name}: http://{target}/metrics")
    results: list[dict] = []
    try:
        with httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {token}"},
                          timeout=600) as api:
            recs = _build(console, api, [t * args.repeat for t in DOCS])
            failed = [r for r in recs if r["status"] != "ready"]
            if failed:
                console.print(f"[red]builds failed: {[(r['id'], r['error']) for r in failed]}")
                return 1
            ids = [r["id"] for r in recs]
            with console.status("generating") as status:
                for i in range(args.requests):
                    for arm in ("recompute", "reuse"):
                        status.update(f"request {i + 1}/{args.requests}, {arm} arm")
                        r = api.post("/v1/generate", json={"documents": ids, "question": QUESTIONS[i % len(QUESTIONS)],
                                                           "max_new_tokens": args.new_tokens, "arm": arm})
                        r.raise_for_status()
                        results.append(r.json())
            fallbacks = _fallbacks(httpx.get(stack.worker_url + "/metrics", timeout=10).text)
        _table(console, recs, results, fallbacks, args)
        if args.hold > 0:
            console.print(f"services stay up for {args.hold:.0f}s (API {stack.api_url}, its OpenAPI document at /openapi.json)")
            time.sleep(args.hold)
    finally:
        with console.status("stopping"):
            codes = stack.stop()
        console.print("stopped: " + ", ".join(f"{n} exit {c}" for n, c in codes.items()))
    return 0 if all(c == 0 for n, c in codes.items() if n != "redis") else 1


def _table(console: Console, recs: list[dict], results: list[dict], fallbacks: dict[str, float], args) -> None:
    by_arm = {arm: [r for r in results if r["arm_requested"] == arm] for arm in ("recompute", "reuse")}
    t = Table(title=f"redknot demo: {len(recs)} documents ({sum(r['n_tokens'] for r in recs)} tokens), "
                    f"TP={args.tp}, {args.requests} request(s) per arm")
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("artifacts built (bytes over all ranks)", f"{sum(r['bytes'] for r in recs) / 2**20:.1f} MiB, "
                                                       f"{sum(r['shards'] for r in recs)} shards, "
                                                       f"{sum(r['build_seconds'] for r in recs):.1f} s")
    for arm, rs in by_arm.items():
        ran = sorted({r["arm"] for r in rs})
        t.add_row(f"TTFT {arm} arm (median; ran: {'/'.join(ran)})",
                  f"{statistics.median(r['ttft_s'] for r in rs):.3f} s" if rs else "-")
    reuse = [r for r in by_arm["reuse"] if r["ledger"]]
    if reuse:
        led = reuse[-1]["ledger"]
        fs = led["flop_saving"]
        t.add_row("artifact fetch before the first reuse request", f"{by_arm['reuse'][0]['fetch_s']:.3f} s")
        t.add_row("1. logical head-row saving (ceiling)",
                  f"{led['head_row_saving']:.1%} ({led['structural_ceiling']:.1%})")
        t.add_row("2. physical token-row saving", f"{led['token_row_saving']:.1%}")
        t.add_row("3. analytic FLOP saving (proj/attn/idx/moe)",
                  f"{fs['total']:.1%} ({fs['projections']:.0%}/{fs['attention']:.0%}/{fs['indexer']:.0%}/"
                  f"{fs['moe']:.0%})")
        rec_t = [r["ttft_s"] for r in by_arm["recompute"]]
        reu_t = [r["ttft_s"] for r in reuse]
        t.add_row("4. measured TTFT ratio recompute/reuse (median)",
                  f"{statistics.median(rec_t) / statistics.median(reu_t):.2f}x")
    t.add_row("fallbacks by reason", str({k: int(v) for k, v in fallbacks.items() if v}) or "{}")
    t.add_row("answer (recompute / reuse, random weights)",
              f"{by_arm['recompute'][0]['answer']!r} / {by_arm['reuse'][0]['answer']!r}"[:80])
    console.print(t)
