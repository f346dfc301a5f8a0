"""TTFT under tensor parallelism (NCCL, one process per GPU): the Flash-shaped model of bench/ttft.py sharded over
--tp ranks, the recompute arm and the reuse arm on the same tokens and offsets. Not a test.

Each rank builds its own artifact (its rank's shards: the latent and compressed state, and the Local W_a·O state
of its channel range). With `--store local` (the default when redis-server is on PATH) rank 0 uploads every
rank's directory as one generation to a real `redknot store serve` process on loopback (Redis index, filesystem
blobs), and each rank then fetches ONLY its own shards through the store client (`StoreClient.fetch_rank`) and
loads them; `--store none` loads the rank directories as written. Before timing, the certified request path
(`runtime.reuse.request.answer`: certificate checks, the one cross-rank agreement) must accept on every rank;
the reuse arm's ledger must show reuse. TTFT = model-forward entry to the first token's logits after --warmup
untimed runs, the slowest rank's CUDA-event time, median of --reps, both arms interleaved.

    python3 bench/ttft_tp.py --tp 2 --lengths 65536,131072 --experts 16 --reps 3 --json ttft_tp2.json
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.ttft import add_model_args, model_config, request, timed  # noqa: E402
from runtime.model.random_init import init_random  # noqa: E402
from runtime.model.deepseek_v4 import Transformer  # noqa: E402
from runtime.reuse.engine import ReuseEngine  # noqa: E402
from runtime.reuse.packing import pin  # noqa: E402
from runtime.reuse.prefetcher import LayerPrefetcher  # noqa: E402
from runtime.reuse.request import ServingIdentity, answer, build  # noqa: E402
from runtime.reuse.certificate import token_hash  # noqa: E402
from runtime.reuse.producer import PRODUCER_VERSION, pad_document  # noqa: E402
from runtime.reuse.roles import channel_range  # noqa: E402
from runtime.reuse.store import load_artifact  # noqa: E402
from bench.report import header, write_json  # noqa: E402

IDENT = ServingIdentity("f" * 64, "bench-tokenizer")
TENANT = "bench"


class LocalStore:
    """redis-server and `redknot store serve` as child processes on loopback, for the benchmark's ranks."""

    def __init__(self, workdir: Path, redis_url: str = ""):
        from services.common.stack import free_port, redis_service, store_service
        self.token = "bench-" + secrets.token_hex(16)
        tokens = workdir / "tokens"
        tokens.write_text(f"{TENANT} {self.token}\n")
        tokens.chmod(0o600)
        self.target = f"127.0.0.1:{free_port()}"
        self.services = []
        if not redis_url:
            port = free_port()
            redis_url = f"redis://127.0.0.1:{port}/0"
            self.services.append(redis_service(port, workdir / "redis", workdir / "redis.log"))
        self.services.append(store_service(self.target, f"127.0.0.1:{free_port()}", redis_url, "bench-store",
                                           workdir / "blobs", tokens, workdir / "store.log"))
        root = Path(__file__).resolve().parent.parent
        for s in self.services:
            s.start(root)
            s.wait_ready()

    def stop(self) -> None:
        for s in reversed(self.services):
            s.stop()


def _timed(fn, group) -> tuple[float, object]:
    """The slowest rank's `timed` fn() (CUDA events on GPU), every rank starting together."""
    dist.barrier()
    secs, out = timed(fn, group.device)
    t = torch.tensor([secs], dtype=torch.float64, device=group.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item()), out


def rank_main(group, args, store_target: str, token: str, workdir: str) -> None:
    from services.store.client import StoreClient
    from services.store.artifact_dir import document_key, read_rank_dir
    torch.manual_seed(0)
    dev = group.device
    cfg, prof = model_config(args)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        model = Transformer(cfg, group.par, dtype, q_chunk=args.q_chunk)
    init_random(model, 0, per_name=True)       # the same replicated tensors on every rank
    model.eval()
    lead = group.rank == 0
    if lead:
        name = f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}" \
            if dev.type == "cuda" else "cpu (gloo)"
        header(f"TP {group.size} ({name}) | Flash dims x {cfg.n_layers} layers, {dtype}, routed "
               f"experts {args.experts} of 256 ({args.experts // group.size} per rank) | profile "
               f"{prof.first_fences}F-{len(prof.reusable_layers(cfg))}R-{prof.last_fences}F, budget "
               f"{prof.budget:.0%} | store: {'gRPC ' + store_target if store_target else 'none (rank dirs)'}", dev)
    rows = []
    root = Path(workdir)
    client = StoreClient(store_target, token, timeout_s=600) if store_target else None
    for L in [int(v) for v in args.lengths.split(",")]:
        docs, question = request(cfg, L, args.docs, args.question, seed=L, spread=args.doc_lengths)
        t0 = time.perf_counter()
        with torch.inference_mode():
            built = [build(model, d, prof, IDENT, root / f"L{L}" / f"doc{i}" / f"rank{group.rank}")
                     for i, d in enumerate(docs)]
        build_s = time.perf_counter() - t0
        dist.barrier()
        fetched_bytes, dirs = 0, built
        via_store = client is not None and L <= args.store_max
        if via_store:
            if lead:                                     # one generation per document: every rank's shards
                for i in range(len(docs)):
                    client.put_artifact(sorted((root / f"L{L}" / f"doc{i}").iterdir()))
            dist.barrier()
            dirs = []
            for i, d in enumerate(built):                # this rank's shards only, through the store client
                rd = read_rank_dir(d)
                key = document_key(rd.certificate, rd.n_content)
                r = client.fetch_rank(key, group.rank, root / f"L{L}" / f"fetched{i}" / f"rank{group.rank}")
                assert all(f".local.r{group.rank}." in n for n in r.files if ".local." in n), r.files
                fetched_bytes += r.bytes
                dirs.append(r.directory)
        # the certified path must accept on every rank (certificates, binding digests, one agreement)
        with torch.inference_mode():
            out = answer(model, prof, docs, dirs, question, IDENT, current_generation=1)
        arms = group.gather(out.arm)
        if lead:
            assert arms == ["reuse"] * group.size, f"the reuse arm fell back: {arms}, {out.verdict}"
        # the same verified artifacts, kept in pinned host memory for the timed runs (hot)
        expect = dict(fingerprint=IDENT.fingerprint, profile=prof.to_dict(), tp_size=group.size,
                      tp_rank=group.rank, channel_range=channel_range(cfg, group.rank, group.size),
                      layers_needed=list(range(cfg.n_layers)), current_generation=1,
                      dtype=str(model.dtype).removeprefix("torch."), producer_version=PRODUCER_VERSION)
        arts = []
        for d, toks in zip(dirs, docs):
            art, v = load_artifact(d, dict(expect, tokens_hash=token_hash(
                pad_document(toks, prof.align, cfg.eos_token_id), IDENT.tokenizer_fingerprint)))
            assert v.ok, v
            arts.append(pin(art))
        full = torch.tensor([t for a in arts for t in a.tokens] + question, device=dev)
        engine = ReuseEngine(model, prof)

        def reuse():
            return engine.prefill(LayerPrefetcher(arts, dev).documents(), question)

        with torch.inference_mode():
            for _ in range(args.warmup):                # warm-up, both arms
                _timed(lambda: model(full), group)
                _timed(reuse, group)
            rec_t, reu_t = [], []
            for _ in range(args.reps):
                rec_t.append(_timed(lambda: model(full), group)[0])
                t, res = _timed(reuse, group)
                reu_t.append(t)
        led = res.ledger.summary()
        assert 0 < led["rows"]["active"] < led["rows"]["relocated"] and led["head_row_saving"] > 0, led
        rec, reu = statistics.median(rec_t), statistics.median(reu_t)
        nbytes = group.gather(fetched_bytes)
        row = dict(tokens=int(full.numel()), recompute_s=rec, reuse_s=reu, speedup=rec / reu,
                   flop_ratio=led["flop_saving"]["ratio"], head_row_saving=led["head_row_saving"],
                   structural_ceiling=led["structural_ceiling"], token_row_saving=led["token_row_saving"],
                   flop_saving=led["flop_saving"], build_s=build_s, active=led["rows"]["active"],
                   relocated=led["rows"]["relocated"], recompute_all=rec_t, reuse_all=reu_t,
                   fetched_bytes_per_rank=nbytes, via_store=via_store)
        rows.append(row)
        if lead:
            print(f"T={row['tokens']:7d}  recompute {rec:7.3f} s  reuse {reu:7.3f} s  speedup {rec / reu:5.2f}x  "
                  f"(analytic FLOP ratio {row['flop_ratio']:.2f}x; head-row {row['head_row_saving']:.1%} of ceiling "
                  f"{row['structural_ceiling']:.1%}; token-row {row['token_row_saving']:.1%}; active "
                  f"{row['active']}/{row['relocated']}; fetched per rank "
                  f"{', '.join(f'{b / 2**30:.2f}' for b in nbytes)} GiB "
                  f"{'through the store client' if via_store else '(rank dirs read directly)'})", flush=True)
        del arts, out, res
        dist.barrier()
        if lead:
            shutil.rmtree(root / f"L{L}", ignore_errors=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if lead:
        write_json(args.json, dict(tp=group.size, experts=args.experts, layers=cfg.n_layers, profile=prof.to_dict(),
                                   store=bool(store_target), rows=rows), args, dev)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    add_model_args(ap, lengths="65536,131072")
    ap.add_argument("--store", default="auto", choices=["auto", "local", "none"],
                    help="local: a redis-server + store process on loopback; auto: local if redis-server is on PATH")
    ap.add_argument("--redis-url", default="")
    ap.add_argument("--store-max", type=int, default=32768,
                    help="lengths above this load the rank directories directly (gRPC moves ~1 GB/s; a 128K "
                         "request's artifacts are ~80 GB)")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.tp < 2:
        raise SystemExit("--tp must be at least 2 (bench/ttft.py is the one-GPU benchmark)")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} CUDA devices; {torch.cuda.device_count()} visible")
    from services.common.tp import launch
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="redknot-ttft-tp-"))
    workdir.mkdir(parents=True, exist_ok=True)
    use_store = args.store == "local" or (args.store == "auto" and (args.redis_url or shutil.which("redis-server")))
    store = LocalStore(workdir, args.redis_url) if use_store else None
    try:
        return launch(args.tp, rank_main, (args, store.target if store else "", store.token if store else "",
                                           str(workdir / "ranks")), device=args.device)
    finally:
        if store is not None:
            store.stop()


if __name__ == "__main__":
    sys.exit(main())
