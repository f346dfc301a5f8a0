"""`redknot reuse-demo`: artifacts for a few documents on the demo model, one request in both arms, the first
token of each arm, TTFT per arm, the ledger's four namespaces and the certificate verdict."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from runtime.demo import ensure_checkpoint
from runtime.model.checkpoint import load_tokenizer
from runtime.model.loader import load_model
from runtime.reuse.certificate import FallbackCounter, digest_bytes
from runtime.reuse.producer import pad_document
from runtime.reuse.profile import ReuseProfile
from runtime.reuse.request import ServingIdentity, answer, build

DOCS = [
    "The artifact store keeps immutable shards. A generation becomes visible only when every shard is stored and "
    "verified, so a half-written generation is never readable. ",
    "Relocation rotates the query instead of the cached keys: the stored latent is never rewritten, and partial "
    "outputs of every segment are merged by a log-sum-exp with the sink applied once. ",
    "Fence layers at both ends are always recomputed. In reusable layers most heads restore their projected "
    "contribution while one Global head per group attends the whole request online. ",
]
QUESTION = "Question: what makes a generation visible? Answer:"


def run_reuse_demo(args) -> int:
    console = Console()
    ckpt = Path(args.model) if args.model else ensure_checkpoint(Path(args.workdir), console)
    model = load_model(ckpt)
    tok = load_tokenizer(ckpt)
    cfg = model.cfg
    prof = ReuseProfile(name="demo", first_fences=2, last_fences=2, budget=args.budget)
    ident = ServingIdentity(digest_bytes((ckpt / "config.json").read_bytes()),
                            digest_bytes((ckpt / "tokenizer.json").read_bytes()))
    docs = [(tok.encode(t * args.repeat).ids) for t in DOCS]
    question = tok.encode(QUESTION).ids
    counter = FallbackCounter()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        dirs = [build(model, d, prof, ident, Path(tmp) / f"doc{i}") for i, d in enumerate(docs)]
        t_build = time.perf_counter() - t0
        full = torch.tensor([t for d in docs for t in pad_document(d, prof.align, cfg.eos_token_id)] + question)
        model(full[:256])                                       # warm-up
        t0 = time.perf_counter()
        ref = model(full)
        t_full = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = answer(model, prof, docs, dirs, question, ident, current_generation=1, counter=counter)
        t_reuse = time.perf_counter() - t0
    led = out.ledger.summary() if out.ledger else {}
    table = Table(title=f"redknot reuse-demo: {len(docs)} documents, {full.numel()} tokens, budget {prof.budget:.0%}")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("artifact build (offline, all documents)", f"{t_build:.2f} s")
    table.add_row("certificate verdict", "accepted" if out.verdict.ok else f"FALLBACK: {out.verdict.reason.value}")
    table.add_row("arm that ran", out.arm)
    table.add_row("TTFT recompute arm (CPU)", f"{t_full:.2f} s")
    table.add_row("TTFT reuse arm (CPU, incl. verification)", f"{t_reuse:.2f} s")
    table.add_row("first token: recompute / reuse", f"{tok.decode([int(ref.argmax())])!r} / "
                                                    f"{tok.decode([int(out.logits.argmax())])!r}")
    if led:
        table.add_row("rows prefix / relocated / active / new",
                      f"{led['rows']['prefix']} / {led['rows']['relocated']} / {led['rows']['active']} / "
                      f"{led['rows']['new']}")
        table.add_row("1. logical head-row saving (ceiling)",
                      f"{led['head_row_saving']:.1%} ({led['structural_ceiling']:.1%})")
        table.add_row("2. physical token-row saving", f"{led['token_row_saving']:.1%}")
        fs = led["flop_saving"]
        table.add_row("3. analytic FLOP saving (proj/attn/idx/moe)",
                      f"{fs['total']:.1%} ({fs['projections']:.0%}/{fs['attention']:.0%}/{fs['indexer']:.0%}/"
                      f"{fs['moe']:.0%}), ratio {fs['ratio']:.2f}x")
    table.add_row("4. measured TTFT ratio recompute/reuse", f"{t_full / t_reuse:.2f}x")
    table.add_row("fallbacks by reason", str({k: v for k, v in counter.snapshot().items() if v}) or "{}")
    console.print(table)
    return 0
