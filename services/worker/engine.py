"""One generate request on one TP rank. Every rank runs this in lockstep (rank 0 broadcast the job):

1. reuse arm: open this rank's shards of every document (`Prefetcher.open`: the host tier, or a fetch from the
   store of only its own rank and channel range), which hands over a source whose head (certificate, manifest)
   and layer groups arrive independently;
2. `runtime.reuse.request.answer_staged`: each rank validates its certificates (fingerprint, tokens, profile,
   TP geometry, layers, the document's current generation, the manifest's digest); a store failure is this
   rank's reason (client.fallback_reason); the ranks agree once before any reuse-specific collective; then the
   reuse forward consumes layer group g as soon as it is verified and staged (and agreed) on every rank, while
   later groups are still arriving; a late group that fails anywhere restarts the request in the recompute arm;
3. decoding (greedy, or sampled with the request's seed: `decode.py`) continues in the arm that ran; the recompute
   arm runs the plain model on the same tokens (`served_tokens`: the profile's preamble, if any, the padded
   documents, the question), so a fallback's answer equals the recompute arm's. Rank 0
   hands each token to the request's sink as it exists; a request whose caller went away stops decoding (the
   ranks agree on that at each step).
Rank 0 then gathers every rank's verdict and fetch statistics, names the root cause of a fallback and
records the metrics."""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Protocol

import torch

from runtime.families import device_of, prefill
from runtime.model.deepseek_v4 import ModelCache
from runtime.reuse.call import RequestState
from runtime.reuse.certificate import BROKEN_ARTIFACT, FallbackReason, Verdict
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.stager import HotSource, StagedSource, Trace
from runtime.reuse.request import answer_staged, preamble_artifact, served_tokens
from services.common.failpoints import Failpoints
from services.common.serving import Binding
from services.common.tp import RankGroup
from services.store.keys import DocumentKey

from .decode import Decoding, Sampler, Sampling
from .prefetch import FetchStats, Prefetcher
from .protocol import Fallback, WorkerHead, WorkerRequest, WorkerResponse
from .tier import TierCounts, TierKey

log = logging.getLogger("redknot.worker")


@dataclass(frozen=True)
class Job:
    request: WorkerRequest
    # (tenant, store key, generation) of the documents of requests queued behind this one
    prefetch: list[tuple[str, DocumentKey, int]] = field(default_factory=list)
    shadow: bool = False        # if the reuse arm runs, keep what a shadow recompute of it needs (rank 0 drew it)
    uncalibrated: str | None = None     # rank 0's calibration gate closed for this reuse request: why (it recomputes)


SHADOW = "__shadow__"           # rank 0's broadcast: every rank runs the pending shadow recompute now


@dataclass(frozen=True)
class ShadowResult:
    """The reuse arm's answer against the recompute arm, teacher-forced on the tokens the reuse arm served: at each
    position, whether both arms' top-1 agree, and KL(recompute || reuse) of the next-token distributions."""
    agreement: float
    kl: float
    positions: int


@dataclass
class _Pending:
    docs: list[list[int]]
    question: list[int]
    tokens: list[int]
    logits: list[torch.Tensor]      # rank 0: the reuse arm's logits at each position (others: empty)


@dataclass
class Running:
    """A request between its prefill and its last token, on every rank."""
    job: Job
    docs: list[list[int]]
    head: WorkerHead | None             # rank 0's
    decoding: Decoding
    first: float                        # perf_counter time of its first token
    verdict: Verdict
    document: int | None
    published: list[Future]
    shadow: bool
    sampler: object
    cache: ModelCache | None = None     # what its decode steps continue (batched with others'): the recompute
    state: RequestState | None = None   # arm's native cache, or the reuse arm's request state

    @property
    def done(self) -> bool:
        return self.decoding.done


class _Recording:
    """A sampler that keeps each position's logits (float32, on their device) before drawing."""

    def __init__(self, sample: Sampler):
        self.sample, self.seen = sample, []

    def __call__(self, logits: torch.Tensor) -> int:
        self.seen.append(logits.reshape(-1).float().clone())
        return self.sample(logits)


class Sink(Protocol):
    """Where rank 0 hands a request's tokens as they exist, and whether its caller still wants them."""

    def start(self, head: WorkerHead) -> None: ...

    def emit(self, token: int) -> None: ...

    def cancelled(self) -> bool: ...


@dataclass(frozen=True)
class RankVerdict:
    rank: int
    reason: str | None
    detail: str
    document: int | None = None         # the index of the document whose artifact this rank rejected on its own


@dataclass(frozen=True)
class RankReport:
    rank: int
    reason: str | None
    detail: str
    fetch: FetchStats
    tier: TierCounts
    tier_bytes: int
    document: int | None = None         # the index of the document whose artifact this rank rejected on its own


def root_cause(reports: list[RankVerdict] | list[RankReport]) -> tuple[str, str, int | None]:
    """A rank that rejected for its own reason names the fallback (and the document at fault, where one was);
    the others only followed it."""
    own = [r for r in reports if r.reason and r.reason != FallbackReason.RANK_DISAGREEMENT.value]
    r = (own or [x for x in reports if x.reason])[0]
    return r.reason, f"rank {r.rank}: {r.detail}", r.document


def _futures(sources: list[StagedSource | HotSource]) -> list[Future]:
    """Every future of the sources still arriving (a tier document has none)."""
    return [f for src in sources if isinstance(src, StagedSource) for f in [src.head] + [g for _, g in src.groups]]


def _stamp(sources: list[StagedSource | HotSource]) -> list[float]:
    """The perf_counter time at which each future of `sources` completes (now, for those already done)."""
    stamps: list[float] = []
    for fut in _futures(sources):
        fut.add_done_callback(lambda _f: stamps.append(time.perf_counter()))
    return stamps


def _wait_all(sources: list[StagedSource | HotSource]) -> None:
    """Until every future of `sources` completed (a failure is the request's verdict already)."""
    wait(_futures(sources))


class RankEngine:
    def __init__(self, group: RankGroup, model, binding: Binding, prefetcher: Prefetcher,
                 failpoints: Failpoints, trace: Trace | None = None):
        self.group, self.model, self.binding, self.prefetcher = group, model, binding, prefetcher
        self.failpoints, self.trace = failpoints, trace
        self.tier = prefetcher.tier
        self.eos = model.cfg.eos_token_id
        self.reuse = ReuseEngine(model, binding.profile)      # the reuse arm's batched decode steps
        # the profile's preamble (every request opens with it, in both arms): its own artifact, computed once here
        self.preamble = preamble_artifact(model, binding.profile, binding.ident)
        self._pending: _Pending | None = None       # the last reuse request's shadow recompute, if one was drawn

    def key(self, tokens: list[int]) -> DocumentKey:
        return self.binding.store_key(tokens)

    @torch.inference_mode()
    def _recompute(self, docs: list[list[int]], question: list[int]):
        dev = device_of(self.model)
        tokens = served_tokens(self.binding.profile, docs, question, self.eos)
        cache = self.model.new_cache()
        return prefill(self.model, torch.tensor(tokens, device=dev), cache), cache

    @property
    def shadow_pending(self) -> bool:
        return self._pending is not None

    def drop_shadow(self) -> None:
        self._pending = None

    @torch.inference_mode()
    def shadow(self) -> ShadowResult | None:
        """The pending shadow recompute, on every rank (rank 0 broadcast SHADOW): the recompute arm over the same
        documents and question, then the tokens the reuse arm served fed in one chunk; rank 0 compares position by
        position with the reuse arm's logits and returns the result (the others None)."""
        p, self._pending = self._pending, None
        logits, cache = self._recompute(p.docs, p.question)
        rec = [logits.float()]
        if len(p.tokens) > 1:
            dev = logits.device
            rec += list(self.model(torch.tensor(p.tokens[:-1], device=dev), cache, all_logits=True).float())
        if not self.group.leader:
            return None
        r, q = torch.stack(rec), torch.stack(p.logits)
        agree = (r.argmax(-1) == q.argmax(-1)).float().mean()
        log_r, log_q = torch.log_softmax(r, -1), torch.log_softmax(q, -1)
        kl = (log_r.exp() * (log_r - log_q)).sum(-1).mean()
        return ShadowResult(float(agree), max(0.0, float(kl)), len(p.tokens))

    def _open(self, req: WorkerRequest) -> tuple[list[StagedSource], list[TierKey], list[Future]]:
        keys = [self.key(d.tokens) for d in req.documents]
        current = iter(self.prefetcher.open_all([(req.tenant, key, d.generation)
                                                 for d, key in zip(req.documents, keys) if d.generation]))
        sources, pinned, published = [], [], []
        for d, key in zip(req.documents, keys):
            opened = next(current) if d.generation else self.prefetcher.open_older(req.tenant, key)
            if opened is None:
                sources.append(self.prefetcher.failed(FallbackReason.MISSING_SHARD,
                                                      f"document {d.id} has no current generation"))
                continue
            sources.append(opened.source)
            if opened.pinned is not None:
                pinned.append(opened.pinned)
            if opened.published is not None:
                published.append(opened.published)
        return sources, pinned, published

    def run(self, job: Job, sink: Sink | None = None) -> tuple[WorkerResponse | None, list[RankReport]]:
        """One request alone, start to finish (every rank returns; rank 0 gets the response and every rank's
        report; `sink`'s cancellation is read on this rank, so at TP > 1 only without one). The worker's loop
        interleaves several with `start`, `advance_all` and `finish`, rank 0 deciding each step for every rank."""
        r = self.start(job, sink)
        while not r.done:
            self.advance_all([r], [sink is not None and sink.cancelled()])
        return self.finish(r)

    def start(self, job: Job, sink: Sink | None = None) -> Running:
        """The request's prefill in the arm it can run, its head to `sink` (rank 0), and its first token."""
        req = job.request
        if job.prefetch:
            self.prefetcher.warm(job.prefetch)
        docs = [d.tokens for d in req.documents]
        fetch_s, published = 0.0, []
        t0 = time.perf_counter()
        if req.arm == "recompute" or job.uncalibrated is not None:
            logits, cache = self._recompute(docs, req.question)
            state = None
            arm, ledger, document = "recompute", None, None
            verdict = Verdict.accept() if req.arm == "recompute" else \
                Verdict.reject(FallbackReason.UNCALIBRATED, job.uncalibrated)
        else:
            self.failpoints.hit("before_fetch")
            sources, pinned, published = self._open(req)
            stamps = _stamp(sources)
            t0 = time.perf_counter()
            try:
                out = answer_staged(self.model, self.binding.profile, docs, sources, req.question,
                                    self.binding.ident, [d.generation for d in req.documents],
                                    control=self.group.control, trace=self.trace,
                                    groups=[range(g.lo, g.hi) for g in self.prefetcher.groups],
                                    preamble=self.preamble)
                logits, arm, verdict, document = out.logits, out.arm, out.verdict, out.document
                cache, state = out.cache, out.state
                ledger = out.ledger.summary() if out.ledger is not None else None
                # this rank's own copy failed verification (the others say rank_disagreement): it leaves the tier,
                # so the next request fetches it again
                if verdict.reason in BROKEN_ARTIFACT:
                    for k in pinned:
                        self.tier.drop(k)
            finally:
                for k in pinned:
                    self.tier.release(k)
            _wait_all(sources)                      # the fetch time: until the last shard arrived (overlapped)
            fetch_s = max(0.0, max(stamps, default=t0) - t0)
        if logits.is_cuda:          # the first token exists once its logits do (the forward is asynchronous)
            torch.cuda.synchronize(logits.device)
        first = time.perf_counter()
        head = self._head(req, docs, arm, verdict, document, ledger, first - t0, fetch_s)
        if sink is not None:
            sink.start(head)
        sampler = Sampler(Sampling(req.temperature, req.top_p, req.seed or 0), logits.device)
        shadow = job.shadow and arm == "reuse"
        if shadow and self.group.leader:
            sampler = _Recording(sampler)
        decoding = Decoding(logits, req.max_new_tokens, None if req.ignore_eos else self.eos, sampler,
                            sink.emit if sink is not None else None)
        return Running(job, docs, head, decoding, first, verdict, document, published, shadow, sampler, cache, state)

    @torch.inference_mode()
    def advance_all(self, rs: list[Running], cancelled: list[bool]) -> list[int]:
        """One decode step of every request in `rs` (every rank, the same plan), in at most two batched forwards:
        the requests that hold a native cache (the recompute arm, and reuse requests that fell back) through
        Transformer.decode, the reuse-arm requests through ReuseEngine.decode_batch over their kept segments
        (rank 0 decided `cancelled` for all: those end before the step). Returns the sizes of the batches that
        ran."""
        native, reuse = [], []
        for r, c in zip(rs, cancelled):
            if c:
                r.decoding.cancel()
            elif not r.done:
                (native if r.cache is not None else reuse).append(r)
        dev = device_of(self.model)
        if native:
            logits = self.model.decode(torch.tensor([r.decoding.last for r in native], device=dev),
                                       [r.cache for r in native])
            for r, row in zip(native, logits):
                r.decoding.draw(row)
        if reuse:
            logits = self.reuse.decode_batch([r.state for r in reuse], [r.decoding.last for r in reuse])
            for r, row in zip(reuse, logits):
                r.decoding.draw(row)
        return [len(b) for b in (native, reuse) if b]

    def finish(self, r: Running) -> tuple[WorkerResponse | None, list[RankReport]]:
        """A done request's bookkeeping (every rank, in the same order): its shadow kept if it was drawn, its fetches
        published to the tier, every rank's report gathered; rank 0 gets the response."""
        decode_s = time.perf_counter() - r.first
        self._pending = _Pending(r.docs, list(r.job.request.question), r.decoding.tokens,
                                 r.sampler.seen if isinstance(r.sampler, _Recording) else []) if r.shadow else None
        wait(r.published)       # what this request fetched is in the tier before the next request looks
        self.failpoints.hit("after_fetch")
        reports = self.group.gather(RankReport(self.group.rank, r.verdict.reason.value if r.verdict.reason else None,
                                               r.verdict.detail, self.prefetcher.take_stats(),
                                               self.tier.take_counts(), self.tier.used, r.document))
        if not self.group.leader:
            return None, reports
        return WorkerResponse(**r.head.model_dump(), tokens=r.decoding.tokens, decode_s=decode_s,
                              finish_reason=r.decoding.finish), reports

    def _head(self, req: WorkerRequest, docs: list[list[int]], arm: str, verdict: Verdict, document: int | None,
              ledger: dict | None, ttft: float, fetch_s: float) -> WorkerHead | None:
        """What is known once the first token's logits exist (rank 0; None on the others): the arm that ran and,
        on a fallback, its root cause over every rank (the ranks agreed on the arm, so all join this gather)."""
        fallback = None
        if arm != req.arm:
            verdicts = self.group.gather(RankVerdict(self.group.rank, verdict.reason.value if verdict.reason else None,
                                                     verdict.detail, document))
            reason, detail, doc = root_cause(verdicts)
            fallback = Fallback(reason=reason, detail=detail, ranks=[r.reason for r in verdicts],
                                document=req.documents[doc].id if doc is not None else None)
            if self.group.leader:
                log.info("fallback to recomputation: %s (%s)", reason, detail)
        if not self.group.leader:
            return None
        cached = 0
        # every document row restored from an artifact (the preamble's too: the prefix), less those recomputed
        if ledger is not None:
            ledger["ttft_s"] = {arm: ttft}
            rows = ledger["rows"]
            cached = max(0, rows["prefix"] + rows["relocated"] - rows["active"])
        prompt = len(served_tokens(self.binding.profile, docs, req.question, self.eos))
        return WorkerHead(arm=arm, ttft_s=ttft, fetch_s=fetch_s, ledger=ledger, fallback=fallback,
                          prompt_tokens=prompt, cached_tokens=cached)
