"""Every Prometheus metric of the API (docs/metrics.md), on a registry `create_app` builds."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class ApiMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.requests = Counter("redknot_requests", "Generate requests by requested arm and outcome",
                                ["arm", "outcome"], registry=self.registry)
        for arm in ("reuse", "recompute"):
            for outcome in ("ok", "error"):
                self.requests.labels(arm, outcome)
