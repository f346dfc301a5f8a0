"""The gRPC adapter: messages in, core calls, messages out; no try/except in handlers.

Requests are parsed here rather than by grpc's generated deserializers, so bytes that are not the declared
message (wrong wire types, garbage) become INVALID_ARGUMENT instead of grpc's generic INTERNAL. The
`ErrorInterceptor` maps the core's errors to status codes with `errors.GRPC_CODE` and records per-method
latency and status in the metrics."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from . import wire
from .auth import TENANT, wrap_handler
from .calibration import CalibrationKey, CalibrationRecords
from .core import ArtifactStore, BeginParams, FetchParams, PutChunk, ValidateParams
from .errors import DeadlineExceeded, InvalidArgument, StoreError, grpc_code
from .index import index_outage
from .metrics import StoreMetrics
from .pb import artifact_store_pb2 as pb

SERVICE = "redknot.store.v1.ArtifactStoreService"
log = logging.getLogger("redknot.store")


class _Malformed:
    def __init__(self, detail: str):
        self.detail = detail


def _parser(cls):
    def parse(raw: bytes):
        try:
            return cls.FromString(raw)
        except DecodeError as e:
            return _Malformed(f"request is not a valid {cls.DESCRIPTOR.full_name}: {e}")
    return parse


def _ok(request):
    if isinstance(request, _Malformed):
        raise InvalidArgument(request.detail)
    return request


@dataclass(frozen=True)
class StreamBounds:
    """Server-side time bounds of a stream (0: none): each message read or written must move within `idle_s`
    (a stalled peer), and the whole stream end within `deadline_s` of its start (a peer that trickles)."""
    idle_s: float = 60.0
    deadline_s: float = 3600.0

    def start(self) -> float:
        return time.monotonic()

    def _wait(self, started: float) -> float | None:
        waits = [t for t in (self.idle_s, self.deadline_s - (time.monotonic() - started) if self.deadline_s else 0)
                 if t]
        return max(0.0, min(waits)) if waits else None

    async def bounded(self, aw, started: float, what: str):
        try:
            return await asyncio.wait_for(aw, self._wait(started))
        except TimeoutError:
            elapsed = time.monotonic() - started
            raise DeadlineExceeded(f"{what}: no message moved within {self.idle_s:g} s or the stream passed its "
                                   f"deadline of {self.deadline_s:g} s ({elapsed:.1f} s since it began)") from None


async def _manifest_pb(m) -> pb.Manifest:
    # a large table (up to 16k shards: ~0.2 s of Python) is converted in a thread, off the event loop
    return await asyncio.to_thread(wire.manifest_to_pb, m) if len(m.shards) > 512 else wire.manifest_to_pb(m)


class StoreServicer:
    def __init__(self, store: ArtifactStore, calibration: CalibrationRecords, bounds: StreamBounds = StreamBounds()):
        self.store, self.calibration, self.bounds = store, calibration, bounds

    async def BeginGeneration(self, request, context):
        r = _ok(request)
        # up to 16k shards: converted in a thread, so health checks and other RPCs keep the event loop meanwhile
        shards = await asyncio.to_thread(lambda: tuple(wire.shard_from_pb(s) for s in r.shards))
        res = await self.store.begin(TENANT.get(), BeginParams(wire.key_from_pb(r.key), r.generation, shards))
        return pb.BeginGenerationResponse(
            generation=res.generation, upload_id=res.upload_id, expires_at_unix_ms=res.expires_at_unix_ms,
            already_stored=[pb.ShardRef(rank=rank, name=name) for rank, name in res.already_stored])

    async def PutShards(self, request_iterator, context):
        async def chunks():
            started, it = self.bounds.start(), aiter(request_iterator)
            while True:
                try:
                    m = await self.bounds.bounded(anext(it), started, "PutShards")
                except StopAsyncIteration:
                    return
                m = _ok(m)
                yield PutChunk(m.upload_id, m.rank, m.name, m.offset, m.data, m.last)

        res = await self.store.put(TENANT.get(), chunks())
        return pb.PutShardsResponse(stored=[pb.ShardRef(rank=rank, name=name) for rank, name in res.stored],
                                    bytes=res.bytes)

    async def CommitGeneration(self, request, context):
        res = await self.store.commit(TENANT.get(), _ok(request).upload_id)
        return pb.CommitGenerationResponse(manifest=await _manifest_pb(res.manifest),
                                           became_current=res.became_current,
                                           current_generation=res.current_generation)

    async def GetManifest(self, request, context):
        r = _ok(request)
        res = await self.store.manifest(TENANT.get(), wire.key_from_pb(r.key), r.generation)
        return pb.GetManifestResponse(manifest=await _manifest_pb(res.manifest),
                                      current_generation=res.current_generation, generations=res.generations)

    async def FetchShards(self, request, context):
        r = _ok(request)
        params = FetchParams(wire.key_from_pb(r.key), r.generation, r.rank, wire.optional_range(r, "layers"),
                             wire.optional_range(r, "channels"), tuple(r.names))
        async for c in self.store.fetch(TENANT.get(), params):
            yield wire.fetch_response_bytes(c.shard, c.generation, c.offset, c.data, c.last)

    async def ValidateCertificate(self, request, context):
        r = _ok(request)
        v = await self.store.validate(TENANT.get(), ValidateParams(
            wire.key_from_pb(r.key), r.tp_rank, wire.optional_range(r, "channels"), tuple(r.layers_needed),
            r.generation, r.certificate_digest, r.deep))
        return pb.ValidateCertificateResponse(
            ok=v.ok, reason=wire.REASON_TO_PB[v.reason] if v.reason else pb.FALLBACK_REASON_UNSPECIFIED,
            detail=v.detail, current_generation=v.current_generation, certificate_digest=v.certificate_digest)

    async def ListDocuments(self, request, context):
        r = _ok(request)
        docs, token = await self.store.list_documents(TENANT.get(), r.page_size, r.page_token, r.doc_hash)
        return pb.ListDocumentsResponse(
            documents=[pb.DocumentSummary(key=wire.key_to_pb(d.key), current_generation=d.current_generation,
                                          generations=d.generations) for d in docs], next_page_token=token)

    async def RetireGeneration(self, request, context):
        r = _ok(request)
        cur = await self.store.retire(TENANT.get(), wire.key_from_pb(r.key), r.generation)
        return pb.RetireGenerationResponse(current_generation=cur)

    async def CollectGarbage(self, request, context):
        r = _ok(request)
        res = await self.store.collect_garbage(TENANT.get(), wire.key_from_pb(r.key) if r.HasField("key") else None)
        return pb.CollectGarbageResponse(blobs_deleted=res.blobs_deleted, bytes_freed=res.bytes_freed,
                                         blobs_kept=res.blobs_kept, temp_files_removed=res.temp_files_removed)

    async def PutCalibration(self, request, context):
        res = await self.calibration.put(TENANT.get(), _ok(request).record)
        return pb.PutCalibrationResponse(
            key=pb.CalibrationKey(checkpoint_fingerprint=res.key.checkpoint_fingerprint, profile=res.key.profile),
            digest=res.digest, stored_at_unix_ms=res.stored_at_unix_ms, replaced=res.replaced)

    async def GetCalibration(self, request, context):
        k = _ok(request).key
        e = await self.calibration.get(CalibrationKey(k.checkpoint_fingerprint, k.profile))
        return pb.GetCalibrationResponse(record=e.record, digest=e.digest, stored_at_unix_ms=e.stored_at_unix_ms,
                                         stored_by=e.stored_by)


def generic_handler(servicer: StoreServicer) -> grpc.GenericRpcHandler:
    """The service's method table, built from the contract's descriptor so it cannot drift from the .proto."""
    service = pb.DESCRIPTOR.services_by_name["ArtifactStoreService"]
    handlers = {}
    for method in service.methods:
        fn = getattr(servicer, method.name)
        req = getattr(pb, method.input_type.name)
        resp = getattr(pb, method.output_type.name)
        kind = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(method.client_streaming, method.server_streaming)]
        # FetchShards yields bytes it serialized itself (wire.fetch_response_bytes): no second serialization
        serialize = None if method.name == "FetchShards" else resp.SerializeToString
        handlers[method.name] = kind(fn, request_deserializer=_parser(req), response_serializer=serialize)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _status(err: BaseException) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(err, StoreError):
        return grpc_code(err), str(err)
    outage = index_outage(err)
    return None if outage is None else (grpc_code(outage), str(outage))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps StoreError (and index outages) to status codes; counts every RPC by method and code."""

    def __init__(self, metrics: StoreMetrics, bounds: StreamBounds = StreamBounds()):
        """`bounds` time the writes of response streams (the servicer times the reads of request streams)."""
        self.metrics, self.bounds = metrics, bounds

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE}/"):
            return handler
        method = details.method.rsplit("/", 1)[-1]
        metrics, bounds = self.metrics, self.bounds

        def record(code: grpc.StatusCode, started: float) -> None:
            metrics.rpcs.labels(method, code.name).inc()
            metrics.latency.labels(method).observe(time.perf_counter() - started)

        async def fail(context, err: Exception, started: float):
            if isinstance(err, grpc.aio.AbortError):       # already a status (e.g. from the auth interceptor)
                record(context.code() or grpc.StatusCode.UNKNOWN, started)
                raise err
            mapped = _status(err)
            if mapped is None:
                log.exception("%s failed", method, exc_info=err)
                mapped = (grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}")
            record(mapped[0], started)
            await context.abort(*mapped)

        def decorate(fn, streams: bool):
            if streams:
                # a coroutine writing with context.write (not a generator handing items to grpc), so each write
                # is bounded: a client that stops reading stalls the write once flow control fills its window
                async def stream_behavior(request, context):
                    started, since = time.perf_counter(), bounds.start()
                    items = fn(request, context)
                    try:
                        async for item in items:
                            await bounds.bounded(context.write(item), since, method)
                    except Exception as e:      # noqa: BLE001 - the one place errors become statuses
                        await fail(context, e, started)
                    finally:
                        await items.aclose()    # now, not when collected: the read-ahead and the blob close
                    record(grpc.StatusCode.OK, started)
                return stream_behavior

            async def behavior(request, context):
                started = time.perf_counter()
                try:
                    result = await fn(request, context)
                except Exception as e:          # noqa: BLE001 - the one place errors become statuses
                    await fail(context, e, started)
                record(grpc.StatusCode.OK, started)
                return result
            return behavior

        return wrap_handler(handler, decorate)

