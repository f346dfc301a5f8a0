"""`redknot store serve`: builds every object from Settings, serves on grpc.aio, stops gracefully.

Order on SIGTERM/SIGINT: health turns NOT_SERVING (load balancers stop routing), the server stops accepting
and gives in-flight RPCs `grace_s` to finish, then the index connection and the metrics endpoint close."""
from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import grpc
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from .auth import AuthInterceptor, TokenTable
from .blob_fs import FilesystemBlobs
from .calibration import CalibrationRecords
from .core import ArtifactStore
from .grpc_service import SERVICE, ErrorInterceptor, StoreServicer, StreamBounds, generic_handler
from .index import RedisIndex
from .local_server import LocalFetchServer
from .keys import MAX_MESSAGE_BYTES, Limits
from .memory import tune_malloc
from .metrics import StoreMetrics
from .redis_client import async_client
from .settings import Settings

log = logging.getLogger("redknot.store")


def build_blobs(s: Settings):
    if s.backend == "fs":
        return FilesystemBlobs(s.blob_root)
    from .blob_s3 import S3Blobs         # boto3 is needed only for this backend
    return S3Blobs(endpoint=s.s3_endpoint, bucket=s.s3_bucket, prefix=s.s3_prefix, region=s.s3_region,
                   spool=Path(s.blob_root) / "spool")


def _host_port(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


async def serve(s: Settings, *, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> int:
    tokens = TokenTable.parse(s.tokens, s.tokens_file)
    if not len(tokens):
        raise SystemExit("no tenants: give --tokens-file or REDKNOT_STORE_TOKENS")
    metrics = StoreMetrics()
    # A bounded pool: index connections grow with concurrency up to the limit, then RPCs wait for one. Pooled
    # connections die with a Redis restart: one idle for `redis_health_check_s` is pinged before use, and a command
    # that meets a dead or reset connection reconnects and runs again (5 tries, 0.1 s .. 1 s apart: 2.5 s, longer
    # than a restart), so requests in flight across a restart, and the first ones after it, succeed instead of
    # failing once per pooled connection. Only connection errors are retried, never a timeout (after which a
    # script may be running still). A reset can come after a script ran: a retried Begin then opens a second
    # upload (the first expires and GC releases its pins), a retried Commit answers NotFound for an upload it
    # already committed (GetManifest shows the generation).
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), 5, supported_errors=(RedisConnectionError,))
    redis_client = async_client(s.redis_url, s.redis_connections, socket_timeout=30, socket_connect_timeout=5,
                                health_check_interval=s.redis_health_check_s, retry=retry,
                                retry_on_error=[RedisConnectionError])
    await redis_client.ping()
    store = ArtifactStore(RedisIndex(redis_client, s.redis_prefix), build_blobs(s), metrics,
                          limits=Limits(s.max_shard_bytes, s.max_shards_per_generation), upload_ttl_s=s.upload_ttl_s,
                          spool_stale_s=s.spool_stale_s,
                          failpoints=[f.strip() for f in s.failpoints.split(",") if f.strip()])

    bounds = StreamBounds(s.stream_idle_s, s.stream_deadline_s)
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(metrics, bounds), AuthInterceptor(tokens)],
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    calibration = CalibrationRecords(redis_client, s.redis_prefix, s.admins())
    server.add_generic_rpc_handlers((generic_handler(StoreServicer(store, calibration, bounds)),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         reflection.SERVICE_NAME), server)
    if s.tls_cert:
        creds = grpc.ssl_server_credentials(
            [(Path(s.tls_key).read_bytes(), Path(s.tls_cert).read_bytes())],
            root_certificates=Path(s.tls_client_ca).read_bytes() if s.tls_client_ca else None,
            require_client_auth=bool(s.tls_client_ca))
        port = server.add_secure_port(s.listen, creds)
    else:
        port = server.add_insecure_port(s.listen)
    if port == 0:
        raise SystemExit(f"cannot listen on {s.listen}")

    local = None
    if s.local_socket:
        local = LocalFetchServer(store, tokens, s.local_socket, mode=int(s.local_socket_mode, 8),
                                 timeout_s=s.local_socket_timeout_s)
        await local.start()

    http = None
    if s.metrics_listen:
        host, mport = _host_port(s.metrics_listen)
        http = start_http_server(mport, addr=host, registry=metrics.registry)

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):      # not the main thread (tests run serve in a thread)
            pass
    await server.start()
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("store serving on %s (port %d, backend %s, %d tenants, admin tenants %s, metrics %s, local socket %s)",
             s.listen, port, s.backend, len(tokens), ",".join(sorted(s.admins())) or "none", s.metrics_listen or "off",
             s.local_socket or "off")
    if http is not None:      # the port bound (the one asked for, or the kernel's pick for port 0): tests read it
        print(f"redknot store: metrics on port {http[0].server_address[1]}", flush=True)
    print(f"redknot store: serving on port {port}", flush=True)
    gc = None
    if s.gc_interval_s:
        gc = asyncio.create_task(collect_garbage_every(store, tokens.tenants(), s.gc_interval_s))
    if ready is not None:
        ready.set()
    await stop.wait()
    if gc is not None:
        gc.cancel()
        await asyncio.gather(gc, return_exceptions=True)

    log.info("store stopping: draining for up to %.1fs", s.grace_s)
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if local is not None:
        await local.close()
    await server.stop(s.grace_s)
    await redis_client.aclose()
    if http is not None:
        http[0].shutdown()
    print("redknot store: stopped", flush=True)
    return 0


async def collect_garbage_every(store: ArtifactStore, tenants: list[str], interval_s: float) -> None:
    """Periodic GC (setting gc_interval_s): every tenant's documents, one pass each interval. Replicas may all run
    it; the per-document GC lock in the index lets one of them collect a document at a time. A failed pass (the
    index or backend away) is logged and counted, and the next one runs on time."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            deleted = 0
            for tenant in tenants:
                deleted += (await store.collect_garbage(tenant, None)).blobs_deleted
            store.metrics.gc_runs.labels("ok").inc()
            log.info("periodic GC: %d blobs deleted over %d tenants", deleted, len(tenants))
        except Exception:               # noqa: BLE001 - a pass fails, the loop goes on
            store.metrics.gc_runs.labels("error").inc()
            log.exception("periodic GC pass failed")


def main(s: Settings) -> int:
    tune_malloc()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(s))
