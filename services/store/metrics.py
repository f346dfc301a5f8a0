"""Every Prometheus metric of the store, in one place, on a registry the server builds and passes in.
Label values are bounded: RPC method names of the contract, status code names, a fixed stage set."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.bytes_in = Counter("redknot_store_bytes_in", "Shard bytes received and verified", registry=r)
        # path: grpc (FetchShards, verified by the server before the last chunk) or local (descriptors handed to a
        # co-located reader over the local socket after a size check; the reader verifies the digest)
        self.bytes_out = Counter("redknot_store_bytes_out", "Shard bytes served (path: grpc, local)", ["path"],
                                 registry=r)
        self.shards_stored = Counter("redknot_store_shards_stored", "Shards stored and verified", registry=r)
        self.shards_deduplicated = Counter("redknot_store_shards_deduplicated",
                                           "Declared shards whose bytes were already stored", registry=r)
        self.shards_served = Counter("redknot_store_shards_served", "Shards served whole (path: grpc, local)",
                                     ["path"], registry=r)
        self.commits = Counter("redknot_store_commits", "Generation commits by result", ["result"], registry=r)
        self.digest_failures = Counter("redknot_store_digest_failures",
                                       "Bytes that did not match their digest (stage: write, read)", ["stage"],
                                       registry=r)
        self.gc_blobs_deleted = Counter("redknot_store_gc_blobs_deleted", "Blobs deleted by GC", registry=r)
        self.gc_runs = Counter("redknot_store_gc_runs", "Periodic GC passes over every tenant by result (ok, error)",
                               ["result"], registry=r)
        self.rpcs = Counter("redknot_store_rpcs", "RPCs by method and status code", ["method", "code"], registry=r)
        self.latency = Histogram("redknot_store_rpc_seconds", "RPC latency by method", ["method"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        for stage in ("write", "read"):
            self.digest_failures.labels(stage)        # present at zero, so a rate() works from the start
        for path in ("grpc", "local"):
            self.bytes_out.labels(path)
            self.shards_served.labels(path)
        for result in ("ok", "already_exists", "incomplete", "not_found", "error"):
            self.commits.labels(result)
        for result in ("ok", "error"):
            self.gc_runs.labels(result)
