"""One generate request on one TP rank. Every rank runs this in lockstep (rank 0 broadcast the job):

1. reuse arm: make sure this rank's shards of every document are in the host tier (fetching only its own rank
   and channel range); a store failure is this rank's fallback verdict (client.fallback_reason);
2. agreement on those verdicts (one all_gather_object): a rank without its shards makes every rank fall back;
3. `runtime.reuse.request.answer`: each rank validates its certificates (fingerprint, tokens, profile, TP
   geometry, layers, the document's current generation, every digest) and the ranks agree once more before
   any reuse-specific collective; then reuse, or the counted fallback to full recomputation;
4. greedy decoding continues in the arm that ran; the recompute arm runs the plain model on the same padded
   tokens, so a fallback's answer equals the recompute arm's.
Rank 0 then gathers every rank's verdict and fetch statistics, names the root cause of a fallback and
records the metrics."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.model.deepseek_v4 import Transformer
from runtime.reuse.certificate import FallbackReason, Verdict, agree
from runtime.reuse.producer import pad_document
from runtime.reuse.request import answer
from services.common.failpoints import Failpoints
from services.common.serving import Binding
from services.common.tp import RankGroup
from services.store.client import fallback_reason
from services.store.errors import StoreError
from services.store.keys import DocumentKey

from .prefetch import FetchStats, Prefetcher
from .protocol import Fallback, WorkerRequest, WorkerResponse
from .tier import TierKey

log = logging.getLogger("redknot.worker")
# a rank whose own copy failed verification drops it from the tier, so the next request fetches it again
_DROP_ON = {FallbackReason.DIGEST_MISMATCH, FallbackReason.MISSING_SHARD, FallbackReason.MISSING_LAYER}


@dataclass(frozen=True)
class Job:
    request: WorkerRequest
    # (tenant, store key, generation) of the documents of requests queued behind this one
    prefetch: list[tuple[str, DocumentKey, int]] = field(default_factory=list)


@dataclass(frozen=True)
class RankReport:
    rank: int
    reason: str | None
    detail: str
    fetch: FetchStats
    tier_hits: int
    tier_misses: int


def root_cause(reports: list[RankReport]) -> tuple[str, str]:
    """A rank that rejected for its own reason names the fallback; the others only followed it."""
    own = [r for r in reports if r.reason and r.reason != FallbackReason.RANK_DISAGREEMENT.value]
    r = (own or [x for x in reports if x.reason])[0]
    return r.reason, f"rank {r.rank}: {r.detail}"


def greedy(logits: torch.Tensor, step: Callable[[int], torch.Tensor], n: int, eos: int) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        for i in range(n):
            nxt = int(logits.argmax())
            out.append(nxt)
            if nxt == eos or i == n - 1:
                break
            logits = step(nxt)
    return out


class RankEngine:
    def __init__(self, group: RankGroup, model: Transformer, binding: Binding, prefetcher: Prefetcher,
                 failpoints: Failpoints):
        self.group, self.model, self.binding, self.prefetcher = group, model, binding, prefetcher
        self.failpoints = failpoints
        self.tier = prefetcher.tier
        self.eos = model.cfg.eos_token_id

    def key(self, tokens: list[int]) -> DocumentKey:
        return self.binding.store_key(tokens)

    @torch.inference_mode()
    def _recompute(self, docs: list[list[int]], question: list[int]):
        dev = self.model.embed.weight.device
        padded = [t for d in docs for t in pad_document(d, self.binding.profile.align, self.eos)]
        cache = self.model.new_cache()
        logits = self.model(torch.tensor(padded + list(question), device=dev), cache)
        return logits, lambda t: self.model(torch.tensor([t], device=dev), cache)

    def _gather_dirs(self, req: WorkerRequest) -> tuple[list[Path], list[TierKey], Verdict]:
        dirs, pinned = [], []
        for d in req.documents:
            key = self.key(d.tokens)
            if d.generation == 0:
                older = self.tier.older(req.tenant, key.doc_id)
                if older is None:
                    return dirs, pinned, Verdict.reject(FallbackReason.MISSING_SHARD,
                                                        f"document {d.id} has no current generation")
                pinned.append(older[0])
                dirs.append(older[1])
                continue
            try:
                tkey, path = self.prefetcher.ensure(req.tenant, key, d.generation)
            except StoreError as e:
                return dirs, pinned, Verdict.reject(FallbackReason(fallback_reason(e).value),
                                                    f"document {d.id}: {type(e).__name__}: {e}")
            pinned.append(tkey)
            dirs.append(path)
        return dirs, pinned, Verdict.accept()

    def run(self, job: Job) -> tuple[WorkerResponse | None, list[RankReport]]:
        """Every rank returns; rank 0 gets the response and every rank's report."""
        req = job.request
        if job.prefetch:
            self.prefetcher.warm(job.prefetch)
        docs = [d.tokens for d in req.documents]
        fetch_s, pinned, local = 0.0, [], Verdict.accept()
        if req.arm == "recompute":
            t0 = time.perf_counter()
            logits, step = self._recompute(docs, req.question)
            arm, ledger, verdict = "recompute", None, Verdict.accept()
        else:
            t_fetch = time.perf_counter()
            dirs, pinned, local = self._gather_dirs(req)
            fetch_s = time.perf_counter() - t_fetch
            self.failpoints.hit("after_fetch")
            try:
                verdict = agree(local, self.group.par)      # did every rank get its shards?
                t0 = time.perf_counter()
                if verdict.ok:
                    out = answer(self.model, self.binding.profile, docs, dirs, req.question, self.binding.ident,
                                 current_generation=[d.generation for d in req.documents])
                    logits, step, arm, verdict = out.logits, out.step, out.arm, out.verdict
                    ledger = out.ledger.summary() if out.ledger is not None else None
                else:
                    logits, step = self._recompute(docs, req.question)
                    arm, ledger = "recompute", None
                if verdict.reason in _DROP_ON and local.ok:
                    for k in pinned:
                        self.tier.drop(k)
            finally:
                for k in pinned:
                    self.tier.release(k)
        first = time.perf_counter()
        tokens = greedy(logits, step, req.max_new_tokens, self.eos)
        ttft = first - t0
        hits, misses = self.tier.take_counts()
        reports = self.group.gather(RankReport(self.group.rank, verdict.reason.value if verdict.reason else None,
                                               verdict.detail, self.prefetcher.take_stats(), hits, misses))
        if not self.group.leader:
            return None, reports
        fallback = None
        if arm != req.arm:
            reason, detail = root_cause(reports)
            fallback = Fallback(reason=reason, detail=detail, ranks=[r.reason for r in reports])
            log.info("fallback to recomputation: %s (%s)", reason, detail)
        if ledger is not None:
            ledger["ttft_s"] = {arm: ttft}
        return WorkerResponse(tokens=tokens, arm=arm, ttft_s=ttft, fetch_s=fetch_s, ledger=ledger,
                              fallback=fallback), reports
