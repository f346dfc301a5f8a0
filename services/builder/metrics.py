"""Every Prometheus metric of the builder (docs/metrics.md), on a registry the server builds and passes in."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

RESULTS = ("ok", "retry", "dead_letter")


class BuilderMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("redknot_build_queue_depth", "Jobs not done: undelivered, pending, waiting to retry",
                                 registry=r)
        self.builds = Counter("redknot_builds", "Build attempts by result", ["result"], registry=r)
        self.seconds = Histogram("redknot_build_seconds", "Producer + upload time per document",
                                 buckets=(.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800), registry=r)
        self.redis_errors = Counter("redknot_builder_redis_errors", "Build-loop passes that lost Redis (the loop "
                                    "backs off and retries; it never exits on a lost connection)", registry=r)
        for res in RESULTS:
            self.builds.labels(res)
