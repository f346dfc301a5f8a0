"""`redknot worker --tp N`: every rank loads its shard of the model and its tier; rank 0 also serves HTTP
(http.py, uvicorn on a thread of its own) and feeds requests, one at a time, to all ranks.

Rank 0's HTTP side only validates and enqueues; its main thread owns the TP loop: take a request (or an idle
tick, so followers never wait long in the broadcast), broadcast it with the documents of the requests queued
behind it (the prefetch hints), run it on every rank (its tokens go to its stream as they exist), record the
metrics, answer."""
from __future__ import annotations

import logging
import queue
import random
import signal
import threading
import time

import torch
import uvicorn

from runtime.reuse.roles import channel_range
from services.common.failpoints import Failpoints
from services.common.serving import Binding, checkpoint_identity, load_profile, serving_dtype
from services.common.tenants import Tenants
from services.common.tp import STOP, RankGroup, launch

from .engine import SHADOW, Job, RankEngine, RankReport
from .exchange import ShardExchange
from .http import Frontend, create_app
from .metrics import WorkerMetrics
from .prefetch import Prefetcher
from .protocol import WorkerResponse
from .settings import WorkerSettings
from .tier import PinnedTier

log = logging.getLogger("redknot.worker")
START_S = 30.0              # longest wait for the HTTP server to bind


def _host_port(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def record(metrics: WorkerMetrics, resp: WorkerResponse, reports: list[RankReport]) -> None:
    metrics.ttft.labels(resp.arm).observe(resp.ttft_s)
    if resp.ledger is not None:
        metrics.observe_ledger(resp.ledger)
    if resp.fallback is not None:
        metrics.fallbacks.labels(resp.fallback.reason).inc()
    for r in reports:
        metrics.fetch_bytes.inc(r.fetch.bytes)
        metrics.exchange_bytes.inc(r.fetch.exchanged)
        for sec in r.fetch.seconds:
            metrics.fetch_seconds.observe(sec)
        metrics.observe_tier(r.rank, r.tier, r.tier_bytes)


def rank_main(group: RankGroup, s: WorkerSettings) -> None:
    from runtime.model.loader import load_model
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s worker[{group.rank}] %(message)s")
    stop = threading.Event()
    tenants = Tenants.load(s.tokens, s.tokens_file)          # whom the store serves, and (rank 0) who may generate
    front = http = None
    if group.leader:
        metrics = WorkerMetrics()
        front = Frontend(s, metrics, tenants)
        host, port = _host_port(s.listen)
        http = uvicorn.Server(uvicorn.Config(create_app(front), host=host, port=port, log_level="warning",
                                             access_log=False, lifespan="off", timeout_graceful_shutdown=5))
        serving = threading.Thread(target=http.run, name="http", daemon=True)    # no signal handlers off main
        serving.start()
        deadline = time.monotonic() + START_S
        while not http.started:
            if not serving.is_alive() or time.monotonic() > deadline:
                raise SystemExit(f"redknot worker: could not serve HTTP on {s.listen}")
            time.sleep(0.01)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        bound = http.servers[0].sockets[0].getsockname()[1]
        print(f"redknot worker: rank 0 listening on {host}:{bound} (tp {group.size})", flush=True)

    log.info("rank %d on %s (%s)", group.rank, group.device,
             torch.distributed.get_backend() if group.size > 1 else "single process")
    profile = load_profile(s.profile)
    ident = group.broadcast(checkpoint_identity(s.model, s.fingerprint) if group.leader else None)
    model = load_model(s.model, par=group.par, dtype=serving_dtype(s.dtype, group.device), device=group.device)
    model.set_policy(s.runtime_policy())
    cfg = model.cfg
    profile.check(cfg)
    with torch.inference_mode():            # warm-up: first-call costs stay out of the first request's TTFT
        model(torch.full((16,), cfg.bos_token_id, device=group.device))
    tier = PinnedTier(int(s.tier_gib * 2**30))
    prefetcher = Prefetcher(tier, tenants, s.store, group.rank,
                            channel_range(cfg, group.rank, group.size), cfg.n_layers, s.layer_group,
                            s.fetch_threads, local_socket=s.store_local_socket,
                            exchange=ShardExchange(group.rank, group.size, group.exchange) if group.size > 1 else None,
                            control=group.control, tls=s.store_tls())
    engine = RankEngine(group, model, Binding(ident, profile, group.size, cfg.eos_token_id), prefetcher,
                        Failpoints(s.failpoints))
    try:
        if not group.leader:
            while (job := group.broadcast()) != STOP:
                if job == SHADOW:
                    engine.shadow()
                elif job is not None:
                    engine.run(job)
            return
        front.vocab_size = cfg.vocab_size
        front.ready.set()
        print("redknot worker: ready", flush=True)
        while not stop.is_set():
            try:
                req, stream, queued = front.requests.get(timeout=0.5)
            except queue.Empty:
                group.broadcast(None)
                continue
            queue_s = time.perf_counter() - queued
            front.metrics.waiting.set(front.requests.qsize())
            if stream.cancelled():      # its client left while it waited: nothing to run
                continue
            stream.queue_s = queue_s
            front.metrics.running.set(1)
            hints = [(r.tenant, engine.key(d.tokens), d.generation) for r in front.waiting() if r.arm == "reuse"
                     for d in r.documents]
            job = Job(req, hints, shadow=req.arm == "reuse" and random.random() < s.shadow_fraction)
            group.broadcast(job)
            try:
                resp, reports = engine.run(job, stream)
            except Exception as e:
                stream.fail(f"the request failed on the worker: {type(e).__name__}")
                raise
            finally:
                front.metrics.running.set(0)
            resp.queue_s = queue_s
            log.info("request %s: %s arm, ttft %.3f s, %d tokens (%s)%s", stream.request_id, resp.arm, resp.ttft_s,
                     len(resp.tokens), resp.finish_reason, f", fallback {resp.fallback.reason}" if resp.fallback else "")
            record(front.metrics, resp, reports)
            stream.finish(resp)
            if engine.shadow_pending:       # off the critical path: after the answer, only while nobody waits
                if front.requests.empty():
                    group.broadcast(SHADOW)
                    shadow = engine.shadow()
                    front.metrics.shadow.labels("compared").inc()
                    front.metrics.shadow_agreement.observe(shadow.agreement)
                    front.metrics.shadow_kl.observe(shadow.kl)
                    log.info("request %s: shadow recompute over %d positions: top-1 agreement %.3f, KL %.4f",
                             stream.request_id, shadow.positions, shadow.agreement, shadow.kl)
                else:
                    engine.drop_shadow()
                    front.metrics.shadow.labels("skipped").inc()
        group.broadcast(STOP)
    finally:
        prefetcher.close()
        if http is not None:
            http.should_exit = True
            serving.join(timeout=10)
            print("redknot worker: stopped", flush=True)


def main(s: WorkerSettings) -> int:
    if not s.model:
        raise SystemExit("redknot worker: --model (REDKNOT_MODEL) is required")
    return launch(s.tp, rank_main, (s,), device=s.device)
