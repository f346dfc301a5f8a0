"""`redknot worker --tp N`: every rank loads its shard of the model and its tier; rank 0 also serves HTTP
(http.py, uvicorn on a thread of its own) and schedules requests for all ranks.

Rank 0's HTTP side only validates and enqueues; its main thread owns the TP loop (`lead`): each turn it broadcasts
one decision to every rank (admit a request, with the documents of the requests queued behind it as prefetch
hints; or one decode step of every running request; or an idle tick, so followers never wait long in the
broadcast), runs it, and answers the requests that finished (their tokens went to their streams as they
existed)."""
from __future__ import annotations

import logging
import queue
import random
import signal
import threading
import time

import torch
import uvicorn

from runtime.families import channel_range
from services.common.failpoints import Failpoints
from services.common.serving import Binding, checkpoint_identity, load_serving_model
from runtime.reuse.profile import ReuseProfile, load_profile
from services.common.tenants import Tenants
from services.common.tp import STOP, RankGroup, launch
from services.store.calibration import CalibrationKey
from services.store.keys import profile_id

from .calibration import CalibrationGate, RecordFile, StoreRecord
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
        metrics.placed_bytes.inc(r.fetch.placed)
        metrics.exchange_bytes.inc(r.fetch.exchanged)
        for sec in r.fetch.seconds:
            metrics.fetch_seconds.observe(sec)
        metrics.observe_tier(r.rank, r.tier, r.tier_bytes)


def follow(group: RankGroup, engine: RankEngine) -> None:
    """A follower rank: rank 0's plan, message by message (see `lead`), until STOP."""
    running: list = []
    while (msg := group.broadcast()) != STOP:
        if msg == SHADOW:
            engine.shadow()
        elif isinstance(msg, Job):
            running.append(engine.start(msg))
        elif isinstance(msg, list):             # a decode round: one step of each running request
            engine.advance_all(running, msg)
        for r in [r for r in running if r.done]:
            running.remove(r)
            engine.finish(r)


def lead(group: RankGroup, engine: RankEngine, front: Frontend, stop: threading.Event) -> None:
    """Rank 0's loop: iteration-level scheduling of up to `max_running` requests. Each turn is one broadcast to
    every rank: a new request (its prefill and first token), or a decode round (one step of every running request,
    with the ones whose caller left marked cancelled), or an idle tick. A request is admitted whenever there is
    room, but never twice in a row while others decode, so a long prefill does not hold the running requests back
    and a new request does not wait for the running ones to finish. Requests that finished are answered in order
    on every rank; a drawn shadow recompute runs once nothing runs or waits."""
    s, metrics = front.s, front.metrics
    running: list = []          # [(Running, Stream)]
    admitted = False
    while not stop.is_set():
        item = None
        if len(running) < s.max_running and not (admitted and running):
            try:
                item = front.requests.get(timeout=0.5) if not running else front.requests.get_nowait()
            except queue.Empty:
                pass
        if item is not None:
            req, stream, queued = item
            metrics.waiting.set(front.requests.qsize())
            if stream.cancelled():      # its client left while it waited: nothing to run
                continue
            stream.queue_s = time.perf_counter() - queued
            hints = [(r.tenant, engine.key(d.tokens), d.generation) for r in front.waiting() if r.arm == "reuse"
                     for d in r.documents]
            gate = front.gate.reason() if req.arm == "reuse" and front.gate is not None else None
            job = Job(req, hints, shadow=req.arm == "reuse" and random.random() < s.shadow_fraction, uncalibrated=gate)
            group.broadcast(job)
            try:
                running.append((engine.start(job, stream), stream))
            except Exception as e:
                stream.fail(f"the request failed on the worker: {type(e).__name__}")
                raise
            admitted = True
        elif running:
            plan = [stream.cancelled() for _, stream in running]
            group.broadcast(plan)
            for n in engine.advance_all([r for r, _ in running], plan):
                metrics.decode_batch.observe(n)
            admitted = False
        else:
            group.broadcast(None)
            continue
        metrics.running.set(len(running))
        for r, stream in [x for x in running if x[0].done]:
            running.remove((r, stream))
            resp, reports = engine.finish(r)
            resp.queue_s = stream.queue_s
            log.info("request %s: %s arm, ttft %.3f s, %d tokens (%s)%s", stream.request_id, resp.arm, resp.ttft_s,
                     len(resp.tokens), resp.finish_reason, f", fallback {resp.fallback.reason}" if resp.fallback else "")
            record(metrics, resp, reports)
            metrics.running.set(len(running))       # before the answer: its client's next request is not counted twice
            stream.finish(resp)
            if engine.shadow_pending:       # off the critical path: after the answer, only while nobody waits
                if not running and front.requests.empty():
                    group.broadcast(SHADOW)
                    shadow = engine.shadow()
                    metrics.shadow.labels("compared").inc()
                    metrics.shadow_agreement.observe(shadow.agreement)
                    metrics.shadow_kl.observe(shadow.kl)
                    log.info("request %s: shadow recompute over %d positions: top-1 agreement %.3f, KL %.4f",
                             stream.request_id, shadow.positions, shadow.agreement, shadow.kl)
                else:
                    engine.drop_shadow()
                    metrics.shadow.labels("skipped").inc()
        metrics.running.set(len(running))
    for _, stream in running:       # stopping: the requests still running end here
        stream.fail("the worker is stopping")


def rank_main(group: RankGroup, s: WorkerSettings) -> None:
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
    model = load_serving_model(s.model, group, s.dtype, s.runtime_policy(), profile)
    cfg = model.cfg
    with torch.inference_mode():            # warm-up: first-call costs stay out of the first request's TTFT
        model(torch.full((16,), cfg.eos_token_id, device=group.device))
    tier = PinnedTier(int(s.tier_gib * 2**30))
    prefetcher = Prefetcher(tier, tenants, s.store, group.rank,
                            channel_range(model, group.rank, group.size), cfg.n_layers, s.layer_group,
                            s.fetch_threads, local_socket=s.store_local_socket,
                            exchange=ShardExchange(group.rank, group.size, group.exchange) if group.size > 1 else None,
                            control=group.control, tls=s.store_tls())
    engine = RankEngine(group, model, Binding(ident, profile, group.size, cfg.eos_token_id), prefetcher,
                        Failpoints(s.failpoints))
    try:
        if not group.leader:
            follow(group, engine)
            return
        front.vocab_size = cfg.vocab_size
        front.gate = CalibrationGate(calibration_source(s, tenants, ident.fingerprint, profile), ident.fingerprint,
                                     profile)
        front.metrics.calibration_bound.set_function(front.gate.agreement_lower_bound)
        front.ready.set()
        print("redknot worker: ready", flush=True)
        lead(group, engine, front, stop)
        group.broadcast(STOP)
    finally:
        prefetcher.close()
        if front is not None and front.gate is not None:
            front.gate.close()
        if http is not None:
            http.should_exit = True
            serving.join(timeout=10)
            print("redknot worker: stopped", flush=True)


def calibration_source(s: WorkerSettings, tenants: Tenants, fingerprint: str,
                       profile: ReuseProfile) -> RecordFile | StoreRecord | None:
    """Where the calibration gate reads its record: the store (any tenant's token reads it), a file, or nowhere."""
    if s.calibration_store:
        key = CalibrationKey(fingerprint, profile_id(profile.to_dict()))
        return StoreRecord(s.store, tenants.any_token, key, tls=s.store_tls(), period_s=s.calibration_poll_s)
    return RecordFile(s.calibration_record) if s.calibration_record else None


def main(s: WorkerSettings) -> int:
    if not s.model:
        raise SystemExit("redknot worker: --model (REDKNOT_MODEL) is required")
    return launch(s.tp, rank_main, (s,), device=s.device, cpus=s.cpus)
