"""The API's side of the loopback HTTP contract with rank 0 of the inference worker (services/worker/protocol.py):
asynchronous, so a request waiting on the worker holds no thread. Every generation streams (NDJSON events): the
tokens as they exist, then the response; closing the stream early stops the request's decoding on the worker."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from services.common.tenants import Tenants
from services.worker.protocol import WorkerHead, WorkerRequest, WorkerResponse

from .errors import Busy, InvalidInput, NotReady, WorkerFailed


class WorkerClient:
    def __init__(self, base_url: str, timeout_s: float, tenants: Tenants):
        """`tenants`: each request carries its tenant's own bearer token, which the worker checks against the
        request's tenant (a process that reaches the worker's port cannot generate as a tenant it has no token
        of). `timeout_s`: the longest wait for the worker's next event."""
        self.http = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=5.0),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.tenants = tenants

    async def aclose(self) -> None:
        await self.http.aclose()

    async def stream(self, req: WorkerRequest,
                     request_id: str = "") -> AsyncIterator[WorkerHead | int | WorkerResponse]:
        """The WorkerHead with the first token, each token id as the worker draws it, then the WorkerResponse.
        Refusals raise before the first token: InvalidInput (422), Busy (429), NotReady (503, or the worker
        unreachable), WorkerFailed."""
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.tenants.token(req.tenant)}"}
        if request_id:
            headers["X-Request-ID"] = request_id
        body = req.model_copy(update={"stream": True}).model_dump_json()
        try:
            async with self.http.stream("POST", "/v1/generate", content=body, headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise _refusal(r)
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    event = json.loads(line)
                    if "token" in event:
                        yield int(event["token"])
                    elif "head" in event:
                        yield WorkerHead.model_validate(event["head"])
                    elif "response" in event:
                        yield WorkerResponse.model_validate(event["response"])
                        return
                    else:
                        raise WorkerFailed(f"inference worker: {event.get('error')}")
        except httpx.TransportError as e:       # refused, reset, timed out: the worker is down or restarting
            raise NotReady(f"inference worker unreachable: {type(e).__name__}") from None
        raise WorkerFailed("the inference worker's stream ended without a response")

    async def generate(self, req: WorkerRequest, request_id: str = "") -> WorkerResponse:
        async for event in self.stream(req, request_id):
            if isinstance(event, WorkerResponse):
                return event
        raise WorkerFailed("the inference worker's stream ended without a response")   # stream() raised already

    async def calibration(self) -> dict:
        """The worker's calibration gate (its /calibration): whether a record is required, the record in force,
        whether the reuse arm runs and, if not, why."""
        try:
            r = await self.http.get("/calibration", timeout=5.0)
        except httpx.TransportError as e:
            raise NotReady(f"inference worker: unreachable ({type(e).__name__})") from None
        if r.status_code != 200:
            raise NotReady(f"inference worker: calibration answered {r.status_code}")
        return r.json()

    async def unready(self) -> str | None:
        """None when the worker is ready; else why (loading, saturated: its queue full, unreachable)."""
        try:
            r = await self.http.get("/readyz", timeout=2.0)
        except httpx.TransportError as e:
            return f"unreachable ({type(e).__name__})"
        if r.status_code == 200:
            return None
        try:
            body = r.json()
            return f"{body['status']} ({body['waiting']} of {body['capacity']} queued)"
        except (ValueError, KeyError, TypeError):
            return f"answered {r.status_code}"


def _refusal(r: httpx.Response) -> Exception:
    try:
        detail = r.json().get("detail")
    except ValueError:
        detail = r.text[:200]
    if r.status_code == 422:
        return InvalidInput(str(detail))
    if r.status_code == 429:
        return Busy(f"inference worker: {detail}")
    if r.status_code == 503:
        return NotReady(f"inference worker: {detail}")
    return WorkerFailed(f"inference worker answered {r.status_code}")
