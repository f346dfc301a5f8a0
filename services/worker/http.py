"""Rank 0's HTTP front (FastAPI on uvicorn, in a thread of its own): it validates, authenticates and enqueues;
the TP loop on the main thread (server.py) runs the requests and hands their tokens back through a `Stream`.

POST /v1/generate answers one JSON `WorkerResponse`, or with `"stream": true` NDJSON events as they exist:
`{"head": WorkerHead}` (the arm that ran, its fallback) with the first token, `{"token": id}` per token, then
`{"response": WorkerResponse}`, or `{"error": detail}` if the request failed. A
client that closes a stream stops its request's decoding (the stream's cancel flag, read at every step); a request
whose client left while it waited is skipped. One error table: every refusal is `{"detail": ...}` with its status."""
from __future__ import annotations

import asyncio
import json
import queue
import secrets
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from services.common.tenants import Tenants

from .metrics import WorkerMetrics
from .protocol import WorkerHead, WorkerRequest, WorkerResponse
from .settings import WorkerSettings

BUSY_RETRY_AFTER_S = 1      # what a 429 (the queue is full) tells the caller to wait
MAX_BODY = 256 << 20


class Refused(Exception):
    """A request refused before it ran: its status and detail (the one error table)."""

    def __init__(self, status: int, detail, headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers or {}


class Stream:
    """One request's events, from the TP loop's thread to its HTTP response on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str = ""):
        self.loop, self.request_id = loop, request_id
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.queue_s = 0.0          # set by the TP loop when it takes the request

    def _put(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:        # the event loop is gone (shutting down): nobody is listening
            self.cancel.set()

    def start(self, head: WorkerHead) -> None:
        head.queue_s = self.queue_s
        self._put(("head", head))

    def emit(self, token: int) -> None:
        self._put(("token", token))

    def cancelled(self) -> bool:
        return self.cancel.is_set()

    def finish(self, resp: WorkerResponse) -> None:
        self._put(("response", resp))

    def fail(self, detail: str) -> None:
        self._put(("error", detail))


class Frontend:
    """Rank 0's side facing HTTP: a bounded queue of (request, stream, when queued) and the readiness flag."""

    def __init__(self, s: WorkerSettings, metrics: WorkerMetrics, tenants: Tenants):
        self.s, self.metrics = s, metrics
        self.tenants = tenants                                   # who may generate as whom
        self.requests: queue.Queue[tuple[WorkerRequest, Stream, float]] = queue.Queue(maxsize=s.max_queue)
        self.ready = threading.Event()
        self.vocab_size = 0
        self.gate = None                                         # CalibrationGate, once the model is loaded

    def submit(self, req: WorkerRequest, stream: Stream) -> None:
        bad = [t for d in req.documents for t in d.tokens if not 0 <= t < self.vocab_size]
        bad += [t for t in req.question if not 0 <= t < self.vocab_size]
        if bad:
            raise Refused(422, f"token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if req.seed is None:        # drawn here, so every rank samples with the same generator
            req.seed = secrets.randbits(63)
        try:
            self.requests.put_nowait((req, stream, time.perf_counter()))
        except queue.Full:          # busy, not down: 429, and when to come back
            raise Refused(429, f"{self.s.max_queue} requests already waiting",
                          {"Retry-After": str(BUSY_RETRY_AFTER_S)}) from None
        self.metrics.waiting.set(self.requests.qsize())

    def waiting(self) -> list[WorkerRequest]:
        with self.requests.mutex:
            return [r for r, _, _ in list(self.requests.queue)[:2]]


def _line(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def create_app(front: Frontend) -> FastAPI:
    app = FastAPI(title="RedKnot-MLA worker", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(Refused)
    async def refused(_request: Request, exc: Refused) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Ready once the model is loaded and while its queue has room (a saturated worker is taken out of a
        Service's endpoints until it drains)."""
        waiting, capacity = front.requests.qsize(), front.s.max_queue
        status = "loading" if not front.ready.is_set() else "saturated" if waiting >= capacity else "ready"
        return JSONResponse({"status": status, "waiting": waiting, "capacity": capacity},
                            status_code=200 if status == "ready" else 503)

    @app.get("/calibration")
    async def calibration() -> JSONResponse:
        """The calibration gate: whether a record is required, the record in force, whether the reuse arm runs
        and, if not, why (503 while loading)."""
        if front.gate is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse(front.gate.describe())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(front.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/generate")
    async def generate(request: Request):
        declared = request.headers.get("content-length", "")
        if not declared.isdigit() or not 0 < int(declared) <= MAX_BODY:
            raise Refused(413 if declared.isdigit() and int(declared) else 400, f"body of {declared or '?'} bytes")
        try:
            req = WorkerRequest.model_validate_json(await request.body())
        except ValidationError as e:
            raise Refused(422, e.errors(include_url=False, include_context=False, include_input=False)) from None
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        who = front.tenants.tenant(token) if scheme.lower() == "bearer" else None
        if who is None or who != req.tenant:       # the tenant's own token, or nothing runs
            raise Refused(401, "a bearer token of the request's tenant is required")
        if not front.ready.is_set():
            raise Refused(503, "worker is loading")
        stream = Stream(asyncio.get_running_loop(), (request.headers.get("x-request-id") or "-")[:128])
        front.submit(req, stream)
        if req.stream:
            return StreamingResponse(_events(stream), media_type="application/x-ndjson")
        try:
            async with asyncio.timeout(front.s.request_timeout_s):
                while True:
                    kind, value = await stream.events.get()
                    if kind == "response":
                        return Response(value.model_dump_json(), media_type="application/json")
                    if kind == "error":
                        raise Refused(500, value)
        except TimeoutError:
            raise Refused(504, f"no answer within {front.s.request_timeout_s:g} s") from None
        finally:
            stream.cancel.set()         # answered, failed or given up: nothing more is wanted

    return app


async def _events(stream: Stream):
    try:
        while True:
            kind, value = await stream.events.get()
            if kind == "token":
                yield _line({"token": value})
            elif kind == "head":
                yield _line({"head": value.model_dump(mode="json")})
            elif kind == "response":
                yield _line({"response": value.model_dump(mode="json")})
                return
            else:
                yield _line({"error": value})
                return
    finally:        # the stream ended, or its client closed it: decoding stops at the next step
        stream.cancel.set()
