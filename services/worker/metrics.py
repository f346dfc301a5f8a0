"""Every Prometheus metric of the workers (docs/metrics.md), on a registry rank 0 builds; the other ranks send
their fetch and tier counts to rank 0 with every request."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from runtime.reuse.certificate import FallbackReason

from .tier import MISS_REASONS, TierCounts

RATIO_BUCKETS = tuple(i / 20 for i in range(1, 21))
TTFT_BUCKETS = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
FETCH_BUCKETS = (.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30)
KL_BUCKETS = (.001, .003, .01, .03, .1, .3, 1, 3, 10)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
FLOP_OPS = ("projections", "attention", "indexer", "moe", "total")


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.head_row = Histogram("redknot_head_row_saving_ratio", "Namespace 1: logical head-row saving per reuse "
                                  "request", buckets=RATIO_BUCKETS, registry=r)
        self.token_row = Histogram("redknot_token_row_saving_ratio", "Namespace 2: physical token-row saving per "
                                   "reuse request", buckets=RATIO_BUCKETS, registry=r)
        self.flop = Histogram("redknot_flop_saving_ratio", "Namespace 3: analytic FLOP saving per reuse request",
                              ["op"], buckets=RATIO_BUCKETS, registry=r)
        self.ttft = Histogram("redknot_ttft_seconds", "Namespace 4: model-forward entry to first token, by the arm "
                              "that ran", ["arm"], buckets=TTFT_BUCKETS, registry=r)
        self.running = Gauge("redknot_requests_running", "Requests this worker group is computing (prefilled, "
                             "decoding step by step, interleaved; at most its max_running)", registry=r)
        self.waiting = Gauge("redknot_requests_waiting", "Requests queued at this worker group, not yet started",
                             registry=r)
        self.decode_batch = Histogram("redknot_decode_batch_size", "Requests whose decode steps ran in one batched "
                                      "forward (one per decode round and kind: native caches, the recompute arm and "
                                      "fallbacks; reuse-arm request states)", buckets=BATCH_BUCKETS, registry=r)
        self.fallbacks = Counter("redknot_fallbacks", "Explicit fallbacks to recomputation by root reason",
                                 ["reason"], registry=r)
        self.fetch_bytes = Counter("redknot_artifact_fetch_bytes", "Bytes fetched from the store by every rank",
                                   registry=r)
        self.placed_bytes = Counter("redknot_artifact_fetch_placed_bytes", "Of the fetched bytes, those read "
                                    "straight into the slabs the tier keeps (the store's local socket)", registry=r)
        self.exchange_bytes = Counter("redknot_artifact_exchange_bytes", "Shared shard bytes a rank received from "
                                      "the other ranks of its TP group instead of the store", registry=r)
        self.fetch_seconds = Histogram("redknot_artifact_fetch_seconds", "Store fetch latency per document and rank",
                                       buckets=FETCH_BUCKETS, registry=r)
        self.tier = Counter("redknot_cache_tier_requests", "Pinned host tier look-ups by result and, for a miss, why "
                            "(absent, evicted, dropped)", ["tier", "result", "reason"], registry=r)
        self.tier_bytes = Gauge("redknot_tier_bytes", "Bytes held in the pinned host tier, per rank", ["rank"],
                                registry=r)
        self.tier_evictions = Counter("redknot_tier_evictions", "Documents evicted from the pinned host tier for "
                                      "room", ["rank"], registry=r)
        self.shadow_agreement = Histogram("redknot_shadow_agreement_ratio", "Shadow recompute: share of positions "
                                          "where the reuse arm's top-1 token is the recompute arm's, teacher-forced "
                                          "on the served answer", buckets=RATIO_BUCKETS, registry=r)
        self.shadow_kl = Histogram("redknot_shadow_kl", "Shadow recompute: mean KL(recompute || reuse) of the "
                                   "next-token distributions over the served answer's positions (nats)",
                                   buckets=KL_BUCKETS, registry=r)
        self.calibration_bound = Gauge("redknot_calibration_agreement_lower_bound", "Lower end of the 95% interval "
                                       "of teacher-forced top-1 agreement in the calibration record in force (the "
                                       "bound of the shadow-agreement alert); NaN when no record is in force",
                                       registry=r)
        self.calibration_bound.set(float("nan"))
        self.shadow = Counter("redknot_shadow_requests", "Reuse requests drawn for a shadow recompute, by result "
                              "(compared; skipped: requests were waiting)", ["result"], registry=r)
        for result in ("compared", "skipped"):
            self.shadow.labels(result)
        for reason in FallbackReason:
            self.fallbacks.labels(reason.value)
        for op in FLOP_OPS:
            self.flop.labels(op)
        for arm in ("reuse", "recompute"):
            self.ttft.labels(arm)
        self.tier.labels("host", "hit", "resident")
        for reason in MISS_REASONS:
            self.tier.labels("host", "miss", reason)

    def observe_ledger(self, summary: dict) -> None:
        self.head_row.observe(summary["head_row_saving"])
        self.token_row.observe(summary["token_row_saving"])
        for op in FLOP_OPS:
            self.flop.labels(op).observe(summary["flop_saving"][op])

    def observe_tier(self, rank: int, counts: TierCounts, nbytes: int) -> None:
        self.tier.labels("host", "hit", "resident").inc(counts.hits)
        for reason, n in counts.misses.items():
            self.tier.labels("host", "miss", reason).inc(n)
        self.tier_bytes.labels(str(rank)).set(nbytes)
        self.tier_evictions.labels(str(rank)).inc(counts.evictions)
