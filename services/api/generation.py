"""One generation through the worker, on the event loop: the request is prepared on a thread (Redis reads), its
events are streamed from the worker with no thread held while it waits, and its metrics and self-healing run on
a thread when it ends, however it ends (answered, stopped early by a stop sequence, or its client gone).
Every route (/v1/generate, /v1/completions, /v1/chat/completions) goes through here."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import anyio

from services.worker.protocol import WorkerHead, WorkerResponse

from .core import ArtifactApi, Prepared, Timings
from .worker_client import WorkerClient


class Generations:
    def __init__(self, core: ArtifactApi, worker: WorkerClient, threads: anyio.CapacityLimiter):
        """`threads`: the generate routes' own thread limit (their Redis reads never take the threads the other
        routes run on)."""
        self.core, self.worker, self.threads = core, worker, threads

    async def call(self, fn: Callable, *args):
        """`fn(*args)` of the core on one of the generate routes' threads."""
        return await anyio.to_thread.run_sync(lambda: fn(*args), limiter=self.threads)

    async def stream(self, tenant: str, prepared: Prepared, arrived: float,
                     request_id: str = "") -> AsyncIterator[WorkerHead | int | WorkerResponse]:
        """The worker's events (head, tokens, response). Closing it early stops the request on the worker."""
        t = Timings(arrived=arrived, sent=time.perf_counter())
        head: WorkerHead | None = None
        outcome = "error"
        try:
            async for event in self.worker.stream(prepared.request, request_id):
                if isinstance(event, WorkerResponse):
                    outcome = "ok"
                elif isinstance(event, WorkerHead):
                    head = event
                else:
                    t.first = t.first or time.perf_counter()
                    t.tokens += 1
                yield event
        except GeneratorExit:           # the caller had what it wanted (a stop sequence), or its client left
            outcome = "ok" if head is not None else "cancelled"
            raise
        finally:
            t.done = time.perf_counter()
            self.core.metrics.requests.labels(prepared.request.arm, outcome).inc()
            if head is not None:
                with anyio.CancelScope(shield=True):    # recorded even when the client's task is being cancelled
                    await self.call(self.core.finished, tenant, prepared, head, t)

    async def generate(self, tenant: str, prepared: Prepared, arrived: float, request_id: str = "") -> WorkerResponse:
        resp = None
        async for event in self.stream(tenant, prepared, arrived, request_id):    # to its end: metrics recorded
            if isinstance(event, WorkerResponse):
                resp = event
        assert resp is not None, "the worker client raises when a stream ends without a response"
        return resp
