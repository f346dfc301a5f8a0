"""The API's side of the loopback HTTP contract with rank 0 of the inference worker (services/worker/protocol.py)."""
from __future__ import annotations

import httpx

from services.common.tenants import Tenants
from services.worker.protocol import WorkerRequest, WorkerResponse

from .errors import Busy, InvalidInput, NotReady, WorkerFailed


class WorkerClient:
    def __init__(self, base_url: str, timeout_s: float, tenants: Tenants):
        """`tenants`: each request carries its tenant's own bearer token, which the worker checks against the
        request's tenant (a process that reaches the worker's port cannot generate as a tenant it has no token
        of)."""
        self.http = httpx.Client(base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.tenants = tenants

    def close(self) -> None:
        self.http.close()

    def generate(self, req: WorkerRequest) -> WorkerResponse:
        try:
            r = self.http.post("/v1/generate", content=req.model_dump_json(),
                               headers={"Content-Type": "application/json",
                                        "Authorization": f"Bearer {self.tenants.token(req.tenant)}"})
        except httpx.TransportError as e:       # refused, reset, timed out: the worker is down or restarting
            raise NotReady(f"inference worker unreachable: {type(e).__name__}") from None
        if r.status_code == 422:
            raise InvalidInput(str(r.json().get("detail")))
        if r.status_code == 429:
            raise Busy(f"inference worker: {r.json().get('detail')}")
        if r.status_code == 503:
            raise NotReady(f"inference worker: {r.json().get('detail')}")
        if r.status_code != 200:
            raise WorkerFailed(f"inference worker answered {r.status_code}")
        return WorkerResponse.model_validate_json(r.content)

    def ready(self) -> bool:
        try:
            return self.http.get("/readyz", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False
