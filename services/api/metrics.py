"""Every Prometheus metric of the API (docs/metrics.md), on a registry `create_app` builds, and the ASGI layer
that counts every response."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.reuse.certificate import BROKEN_ARTIFACT

METHODS = ("GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS")
REBUILD_REASONS = tuple(sorted(r.value for r in BROKEN_ARTIFACT))      # a broken artifact: build it again
LATENCY_BUCKETS = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
UNMATCHED = "unmatched"         # the route label of a path no route serves (bounded: never the raw path)


class ApiMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.requests = Counter("redknot_requests", "Generate requests by requested arm and outcome",
                                ["arm", "outcome"], registry=self.registry)
        for arm in ("reuse", "recompute"):
            for outcome in ("ok", "error", "cancelled"):
                self.requests.labels(arm, outcome)
        # vLLM's latency set, from the request's arrival at the API, by the arm that ran
        self.queue_seconds = Histogram("redknot_request_queue_seconds", "Arrival at the API to the worker starting "
                                       "the request (waits at the API and in the worker's queue)", ["arm"],
                                       buckets=LATENCY_BUCKETS, registry=self.registry)
        self.first_token_seconds = Histogram("redknot_time_to_first_token_seconds", "Arrival at the API to the "
                                             "first token (queueing included)", ["arm"], buckets=LATENCY_BUCKETS,
                                             registry=self.registry)
        self.e2e_seconds = Histogram("redknot_e2e_request_latency_seconds", "Arrival at the API to the response",
                                     ["arm"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("redknot_prompt_tokens", "Prompt rows prefilled (padded documents and the "
                                     "question), by the arm that ran", ["arm"], registry=self.registry)
        self.cached_tokens = Counter("redknot_prompt_tokens_cached", "Document rows taken from certified artifacts "
                                     "and not recomputed", ["arm"], registry=self.registry)
        self.generation_tokens = Counter("redknot_generation_tokens", "Tokens generated, by the arm that ran",
                                         ["arm"], registry=self.registry)
        for h in (self.queue_seconds, self.first_token_seconds, self.e2e_seconds, self.prompt_tokens,
                  self.cached_tokens, self.generation_tokens):
            for arm in ("reuse", "recompute"):
                h.labels(arm)
        self.rebuilds = Counter("redknot_rebuilds", "Documents queued for a rebuild because a request met their "
                                "artifact broken, or an upload of the same content found it broken in the store "
                                "(digest, missing shard or layer), by that reason", ["reason"],
                                registry=self.registry)
        for reason in REBUILD_REASONS:
            self.rebuilds.labels(reason)
        self.responses = Counter("redknot_api_responses", "Every HTTP response of the API by method, route "
                                 "template and status code", ["method", "route", "status"], registry=self.registry)


def route_template(routes: list[BaseRoute], scope: Scope) -> str:
    """The path template of the route serving `scope` ("/v1/documents/{doc_id}"), a partial match's (wrong
    method) when no route matches fully, else UNMATCHED."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return getattr(route, "path", UNMATCHED)
        if match is Match.PARTIAL and partial is None:
            partial = getattr(route, "path", UNMATCHED)
    return partial or UNMATCHED


class ResponseCounter:
    """Outermost ASGI layer: counts each response once it has started, by method, route template and status;
    an exception no handler turned into a response counts as the 500 it becomes."""

    def __init__(self, app: ASGIApp, routes: list[BaseRoute], metrics: ApiMetrics):
        self.app, self.routes, self.metrics = app, routes, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def counted(msg) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            status = status or 500
            raise
        finally:
            if status is not None:          # None: the caller left before any answer
                method = scope["method"] if scope["method"] in METHODS else "other"
                self.metrics.responses.labels(method, route_template(self.routes, scope), str(status)).inc()
