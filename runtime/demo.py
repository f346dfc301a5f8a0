"""`redknot demo`: a small random DeepSeek-V4 checkpoint in the official layout (FP8 + FP4), loaded back
through the real loader, a few thousand tokens prefilled in chunks, then greedy decoding, with timings."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from runtime.model.checkpoint import build_demo_tokenizer, load_tokenizer, random_state, write_official_checkpoint
from runtime.model.config import demo as demo_config
from runtime.model.loader import load_model

TEXT = (
    "DeepSeek-V4 keeps one shared latent row per token, a window of the most recent 128 rows, and compressed "
    "entries that pool blocks of four or one hundred twenty-eight rows. Documents are computed once, offline, "
    "and their certified artifacts are reused online so that the first token arrives sooner. "
)


def ensure_checkpoint(workdir: Path, console: Console) -> Path:
    ckpt = workdir / "checkpoint"
    if (ckpt / "config.json").exists():
        return ckpt
    ckpt.mkdir(parents=True, exist_ok=True)
    tok_path = workdir / "tokenizer.json"
    with console.status("building a demo tokenizer and a random checkpoint (FP8 + FP4)"):
        build_demo_tokenizer(1024, tok_path)
        vocab = load_tokenizer(workdir).get_vocab_size()
        cfg = demo_config(vocab)
        write_official_checkpoint(ckpt, cfg, random_state(cfg, seed=0, exact_quant=True), quantize=True,
                                  tokenizer_json=str(tok_path))
    return ckpt


def run_demo(args) -> int:
    console = Console()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    ckpt = Path(args.model) if args.model else ensure_checkpoint(Path(args.workdir), console)
    t0 = time.perf_counter()
    model = load_model(ckpt, device=args.device)
    t_load = time.perf_counter() - t0
    tok = load_tokenizer(ckpt)
    ids = tok.encode(TEXT).ids
    ids = (ids * (args.tokens // max(1, len(ids)) + 1))[: args.tokens]
    tokens = torch.tensor([model.cfg.bos_token_id] + ids[: args.tokens - 1], device=args.device)

    cache = model.new_cache()
    t0 = time.perf_counter()
    logits = model.prefill(tokens, cache, chunk=args.chunk)
    t_prefill = time.perf_counter() - t0
    out, t_steps = [], []
    for _ in range(args.new_tokens):
        nxt = int(logits.argmax())
        out.append(nxt)
        t1 = time.perf_counter()
        logits = model(torch.tensor([nxt], device=args.device), cache)
        t_steps.append(time.perf_counter() - t1)

    c = model.cfg
    table = Table(title=f"redknot demo: {ckpt}")
    table.add_column("what")
    table.add_column("value", justify="right")
    kinds = "".join({"window": "W", "csa": "C", "hca": "H"}[c.layer_kind(i)] for i in range(c.n_layers))
    table.add_row("model", f"{c.n_layers} layers [{kinds}], dim {c.dim}, {c.n_heads} heads, "
                           f"{c.n_routed_experts} experts, vocab {c.vocab_size}")
    table.add_row("checkpoint load (FP8/FP4 dequant)", f"{t_load:.2f} s")
    table.add_row(f"prefill {len(tokens)} tokens (chunks of {args.chunk})",
                  f"{t_prefill:.2f} s  ({len(tokens) / t_prefill:.0f} tok/s)")
    table.add_row("time to first token", f"{t_prefill:.2f} s")
    if t_steps:
        table.add_row(f"greedy decode, {len(t_steps)} tokens", f"{1000 * sum(t_steps) / len(t_steps):.1f} ms/token")
    table.add_row("generated (random weights)", repr(tok.decode(out))[:60])
    console.print(table)
    return 0
