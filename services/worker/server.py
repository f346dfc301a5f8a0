"""`redknot worker --tp N`: every rank loads its shard of the model and its tier; rank 0 also serves HTTP on
loopback and feeds requests, one at a time, to all ranks.

Rank 0's HTTP threads only validate and enqueue; its main thread owns the TP loop: take a request (or an idle
tick, so followers never wait long in the broadcast), broadcast it with the documents of the requests queued
behind it (the prefetch hints), run it on every rank, record the metrics, answer."""
from __future__ import annotations

import json
import logging
import queue
import signal
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from runtime.reuse.roles import channel_range
from services.common.failpoints import Failpoints
from services.common.serving import Binding, checkpoint_identity, load_profile, serving_dtype
from services.common.tenants import Tenants
from services.common.tp import STOP, RankGroup, launch

from .engine import Job, RankEngine, RankReport
from .metrics import WorkerMetrics
from .exchange import ShardExchange
from .prefetch import Prefetcher
from .protocol import WorkerRequest, WorkerResponse
from .settings import WorkerSettings
from .tier import PinnedTier

log = logging.getLogger("redknot.worker")
BUSY_RETRY_AFTER_S = 1      # what a 429 (the queue is full) tells the caller to wait
MAX_BODY = 256 << 20


def _host_port(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


class RejectedRequest(ValueError):
    """A request the model cannot run (token ids outside the vocabulary): 422, nothing ran."""


class Frontend:
    """Rank 0's side facing HTTP: a bounded queue of (request, future) and the readiness flag."""

    def __init__(self, s: WorkerSettings, metrics: WorkerMetrics, tenants: Tenants):
        self.s, self.metrics = s, metrics
        self.tenants = tenants                                   # who may generate as whom
        # (request, its future, when it was queued)
        self.requests: queue.Queue[tuple[WorkerRequest, Future, float]] = queue.Queue(maxsize=s.max_queue)
        self.ready = threading.Event()
        self.vocab_size = 0

    def submit(self, req: WorkerRequest) -> Future:
        bad = [t for d in req.documents for t in d.tokens if not 0 <= t < self.vocab_size]
        bad += [t for t in req.question if not 0 <= t < self.vocab_size]
        if bad:
            raise RejectedRequest(f"token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        fut: Future = Future()
        self.requests.put_nowait((req, fut, time.perf_counter()))       # queue.Full: 429
        self.metrics.waiting.set(self.requests.qsize())
        return fut

    def waiting(self) -> list[WorkerRequest]:
        with self.requests.mutex:
            return [r for r, _, _ in list(self.requests.queue)[:2]]


def make_handler(front: Frontend):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):      # access logs off: the API logs requests
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json",
                  headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, obj) -> None:
            self._send(code, json.dumps(obj).encode())

        def do_GET(self):
            if self.path == "/healthz":
                self._json(200, {"status": "ok"})
            elif self.path == "/readyz":
                ok = front.ready.is_set()
                self._json(200 if ok else 503, {"status": "ready" if ok else "loading"})
            elif self.path == "/metrics":
                self._send(200, generate_latest(front.metrics.registry), CONTENT_TYPE_LATEST)
            else:
                self._json(404, {"detail": f"no route {self.path}"})

        def do_POST(self):
            if self.path != "/v1/generate":
                self._json(404, {"detail": f"no route {self.path}"})
                return
            n = int(self.headers.get("Content-Length") or 0)
            if not 0 < n <= MAX_BODY:
                self._json(413 if n else 400, {"detail": f"body of {n} bytes"})
                return
            try:
                req = WorkerRequest.model_validate_json(self.rfile.read(n))
                scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
                who = front.tenants.tenant(token) if scheme.lower() == "bearer" else None
                if who is None or who != req.tenant:   # the tenant's own token, or nothing runs
                    self._json(401, {"detail": "a bearer token of the request's tenant is required"})
                    return
                if not front.ready.is_set():
                    self._json(503, {"detail": "worker is loading"})
                    return
                fut = front.submit(req)
            except ValidationError as e:
                self._json(422, {"detail": e.errors(include_url=False, include_context=False)})
                return
            except RejectedRequest as e:
                self._json(422, {"detail": str(e)})
                return
            except queue.Full:          # busy, not down: 429, and when to come back
                self._send(429, json.dumps({"detail": f"{front.s.max_queue} requests already waiting"}).encode(),
                           headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})
                return
            resp: WorkerResponse = fut.result(timeout=front.s.request_timeout_s)
            self._send(200, resp.model_dump_json().encode())

    return Handler


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
        http = ThreadingHTTPServer((host, port), make_handler(front))
        http.daemon_threads = True
        threading.Thread(target=http.serve_forever, daemon=True).start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        print(f"redknot worker: rank 0 listening on {host}:{http.server_address[1]} (tp {group.size})", flush=True)

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
                if job is not None:
                    engine.run(job)
            return
        front.vocab_size = cfg.vocab_size
        front.ready.set()
        print("redknot worker: ready", flush=True)
        while not stop.is_set():
            try:
                req, fut, queued = front.requests.get(timeout=0.5)
            except queue.Empty:
                group.broadcast(None)
                continue
            queue_s = time.perf_counter() - queued
            front.metrics.waiting.set(front.requests.qsize())
            front.metrics.running.set(1)
            hints = [(r.tenant, engine.key(d.tokens), d.generation) for r in front.waiting() if r.arm == "reuse"
                     for d in r.documents]
            job = Job(req, hints)
            group.broadcast(job)
            try:
                resp, reports = engine.run(job)
            finally:
                front.metrics.running.set(0)
            resp.queue_s = queue_s
            record(front.metrics, resp, reports)
            fut.set_result(resp)
        group.broadcast(STOP)
    finally:
        prefetcher.close()
        if http is not None:
            http.shutdown()
            print("redknot worker: stopped", flush=True)


def main(s: WorkerSettings) -> int:
    if not s.model:
        raise SystemExit("redknot worker: --model (REDKNOT_MODEL) is required")
    return launch(s.tp, rank_main, (s,), device=s.device)
