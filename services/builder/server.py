"""`redknot builder --tp N`: builds every object from settings inside each rank and runs the build loop."""
from __future__ import annotations

import logging
import signal

from services.common.build_queue import BuildQueue
from services.common.registry import Registry
from services.common.serving import checkpoint_identity, load_serving_model
from runtime.reuse.profile import load_profile
from services.common.tenants import Tenants
from services.common.tp import RankGroup, launch
from services.store.redis_client import sync_client

from .builder import Builder, follow
from .metrics import BuilderMetrics
from .settings import BuilderSettings


def _host_port(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def rank_main(group: RankGroup, s: BuilderSettings) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s builder[{group.rank}] %(message)s")
    profile = load_profile(s.profile)
    ident = group.broadcast(checkpoint_identity(s.model, s.fingerprint) if group.leader else None)
    model = load_serving_model(s.model, group, s.dtype, s.runtime_policy(), profile)
    if not group.leader:
        follow(group, model, profile, ident)
        return
    # pooled connections idle for 30 s are checked before use (a Redis restart leaves them dead)
    r = sync_client(s.redis_url, socket_timeout=30, socket_connect_timeout=5, health_check_interval=30)
    metrics = BuilderMetrics()
    http = None
    if s.metrics_listen:
        from prometheus_client import start_http_server
        host, port = _host_port(s.metrics_listen)
        http = start_http_server(port, addr=host, registry=metrics.registry)
    builder = Builder(group, model, profile, ident, s, BuildQueue(r, s.redis_prefix, int(s.claim_idle_s * 1000)),
                      Registry(r, s.redis_prefix), Tenants.load(s.tokens, s.tokens_file), metrics)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: builder.stop.set())
    try:
        builder.run()
    finally:
        if http is not None:
            http[0].shutdown()
        r.close()
        print("redknot builder: stopped", flush=True)


def main(s: BuilderSettings) -> int:
    if not s.model:
        raise SystemExit("redknot builder: --model (REDKNOT_MODEL) is required")
    return launch(s.tp, rank_main, (s,), device=s.device, cpus=s.cpus)
