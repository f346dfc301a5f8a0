"""One build: every TP rank runs the producer on the document (its own heads and channel range), rank 0 uploads
all ranks' shards to the store as one generation and commits it, then marks the document ready and
acknowledges the queue entry. A job that fails is retried with exponential backoff, then dead-lettered; a job whose
registry record is unreadable is dead-lettered at once with that reason. A lost Redis connection never stops the
builder: the loop backs off (REDIS_RETRY_S doubling to REDIS_RETRY_MAX_S) and carries on once Redis answers again;
the job it held stays pending in the stream and is claimed again.

Invariants:
- nothing is visible before the store's atomic commit; a builder killed at any step leaves at most an
  uncommitted upload (which expires) and a pending queue entry (which is built again);
- a job is idempotent: the generation it commits is fixed when the upload is queued, so a second run of the
  same entry finds the generation committed (AlreadyExists) and only finishes the bookkeeping."""
from __future__ import annotations

import logging
import shutil
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis

from runtime.families import build
from runtime.reuse.profile import ReuseProfile
from runtime.reuse.request import ServingIdentity
from services.common.build_queue import BuildQueue, Job
from services.common.failpoints import Failpoints
from services.common.registry import CorruptRecord, Registry
from services.common.tenants import Tenants
from services.common.tp import STOP, RankGroup
from services.store.artifact_dir import read_generation
from services.store.client import StoreClient
from services.store.errors import AlreadyExists

from .metrics import BuilderMetrics
from .settings import BuilderSettings

log = logging.getLogger("redknot.builder")
REDIS_RETRY_S, REDIS_RETRY_MAX_S = 0.25, 5.0      # back within seconds of Redis (the target: 30 s)
REDIS_LOST = (redis.ConnectionError, redis.TimeoutError)     # BusyLoadingError (Redis replaying its AOF) included


@dataclass(frozen=True)
class BuildTask:
    """What rank 0 broadcasts: every rank builds the same tokens into its own directory under `root`."""
    tokens: list[int]
    generation: int
    root: str


def build_rank(group: RankGroup, model, profile: ReuseProfile, ident: ServingIdentity,
               task: BuildTask) -> str:
    """This rank's artifact; the error text, or "" on success (a rank never raises out of a job: every rank
    must reach the gather that follows)."""
    try:
        build(model, task.tokens, profile, ident.fingerprint, ident.tokenizer_fingerprint,
              Path(task.root) / f"rank{group.rank}", generation=task.generation)
        return ""
    except Exception as e:     # noqa: BLE001 - reported to rank 0, which retries the job
        return f"rank {group.rank}: {type(e).__name__}: {e}"


def follow(group: RankGroup, model, profile: ReuseProfile, ident: ServingIdentity) -> None:
    while (task := group.broadcast()) != STOP:
        if task is not None:
            group.gather(build_rank(group, model, profile, ident, task))


def doubling(first: float, cap: float, n: int) -> float:
    """The n-th wait (1-based) of a backoff that starts at `first` and doubles up to `cap`."""
    return min(first * 2 ** (n - 1), cap)


def retry_delay(s: BuilderSettings, attempt: int) -> float:
    """The wait after failed attempt `attempt` (1-based): backoff_s doubling, capped at backoff_max_s."""
    return doubling(s.backoff_s, s.backoff_max_s, attempt)


class BuildError(RuntimeError):
    """A rank failed to produce its artifact; the job is retried."""


class Builder:
    """Rank 0's loop: claim, build on every rank, upload, commit, mark ready, acknowledge."""

    def __init__(self, group: RankGroup, model, profile: ReuseProfile, ident: ServingIdentity,
                 s: BuilderSettings, queue: BuildQueue, registry: Registry, tenants: Tenants, metrics: BuilderMetrics):
        self.group, self.model, self.profile, self.ident, self.s = group, model, profile, ident, s
        self.queue, self.registry, self.tenants, self.metrics = queue, registry, tenants, metrics
        self.failpoints = Failpoints(s.failpoints)
        self.workdir = Path(s.workdir)
        self.stop = threading.Event()
        self.store_tls = s.store_tls()

    def run(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)        # leftovers of a killed builder: never uploaded
        self.workdir.mkdir(parents=True, exist_ok=True)
        print(f"redknot builder: consuming as {self.s.consumer!r} (tp {self.group.size})", flush=True)
        lost, grouped = 0, False                    # consecutive passes without Redis; the consumer group exists
        while not self.stop.is_set():
            try:
                if not grouped:
                    self.queue.ensure_group()
                    grouped = True
                self.metrics.queue_depth.set(self.queue.depth())
                job = self.queue.claim(self.s.consumer, block_ms=500)
                if job is None:
                    self.group.broadcast(None)      # followers wait in the broadcast; an idle tick keeps it short
                else:
                    self.process(job)
                lost = 0
            except REDIS_LOST as e:
                lost += 1
                delay = doubling(REDIS_RETRY_S, REDIS_RETRY_MAX_S, lost)
                self.metrics.redis_errors.inc()
                log.warning("Redis unavailable (%s: %s); retrying in %.2fs", type(e).__name__, e, delay)
                self.group.broadcast(None)
                self.stop.wait(delay)
        self.group.broadcast(STOP)

    # -------------------------------------------------------------------------------------------------
    def process(self, job: Job) -> None:
        try:
            rec = self.registry.get(job.tenant, job.doc)
        except CorruptRecord as e:                 # nothing to build from: say why, and go on with the queue
            err = f"{type(e).__name__}: {e}"
            self.queue.dead_letter(job, 0, err)
            self.metrics.builds.labels("dead_letter").inc()
            log.error("job %s/%s dead-lettered: its registry record is unreadable: %s", job.tenant, job.doc, e)
            return
        if rec is None or rec.status == "retired" or (rec.status == "ready" and
                                                       rec.generation >= rec.target_generation):
            self.queue.done(job)                    # nothing to build, or a duplicate of a finished job
            return
        attempt = self.registry.start_attempt(job.tenant, job.doc)
        if attempt > self.s.max_attempts:          # it crashed the builder on every attempt: poison
            self._dead(job, attempt, "the builder stopped during every attempt")
            return
        beat = threading.Event()
        hb = threading.Thread(target=self._heartbeat, args=(job, beat), daemon=True)
        hb.start()
        root = self.workdir / f"{job.tenant}-{job.doc}-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        try:
            key, nbytes, shards = self._build_and_commit(job, rec.target_generation, root)
            self.registry.mark_ready(job.tenant, job.doc, rec.target_generation, key, nbytes, shards,
                                     time.perf_counter() - t0)
            self.queue.done(job)
            self.metrics.builds.labels("ok").inc()
            self.metrics.seconds.observe(time.perf_counter() - t0)
            log.info("built %s/%s generation %d in %.2fs", job.tenant, job.doc, rec.target_generation,
                     time.perf_counter() - t0)
        except Exception as e:     # noqa: BLE001 - any failure of a job is retried, then dead-lettered
            err = f"{type(e).__name__}: {e}"
            log.warning("build of %s/%s failed (attempt %d): %s\n%s", job.tenant, job.doc, attempt, err,
                        traceback.format_exc())
            if attempt < self.s.max_attempts and not isinstance(e, CorruptRecord):    # a broken record stays broken
                delay = retry_delay(self.s, attempt)
                self.registry.update(job.tenant, job.doc, status="queued", stage=f"retry in {delay:.1f}s",
                                     error=err)
                self.queue.retry(job, attempt, delay)
                self.metrics.builds.labels("retry").inc()
            else:
                self._dead(job, attempt, err)
        finally:
            beat.set()
            hb.join()
            shutil.rmtree(root, ignore_errors=True)

    def _build_and_commit(self, job: Job, generation: int, root: Path) -> tuple[dict, int, int]:
        """(store key, bytes, shards) of the committed generation."""
        tokens = self.registry.tokens(job.tenant, job.doc)
        self.registry.update(job.tenant, job.doc, stage=f"producing on {self.group.size} rank(s)", progress=0.05)
        task = BuildTask(tokens, generation, str(root))
        self.group.broadcast(task)
        errors = [e for e in self.group.gather(build_rank(self.group, self.model, self.profile, self.ident, task)) if e]
        if errors:
            raise BuildError("; ".join(errors))
        self.failpoints.hit("producing")
        key, gen, shards = read_generation(sorted(root.iterdir()))
        assert gen == generation, (gen, generation)
        nbytes = sum(s.size for s, _ in shards)
        self.registry.update(job.tenant, job.doc, stage="uploading", progress=0.6, bytes=nbytes, shards=len(shards))
        with StoreClient(self.s.store, self.tenants.token(job.tenant), tls=self.store_tls) as client:
            try:
                b = client.begin(key, [s for s, _ in shards], generation)
                have = set(b.already_stored)
                todo = [(s, p) for s, p in shards if s.ref not in have]
                if todo:
                    client.put(b.upload_id, todo)
                self.registry.update(job.tenant, job.doc, stage="committing", progress=0.9)
                self.failpoints.hit("before_commit")
                client.commit(b.upload_id)
            except AlreadyExists:
                # the same entry ran before and committed (a redelivery after a crash): that generation must be
                # readable, else it was retired and this job is wrong (NotFound: retried, then dead-lettered)
                client.manifest(key, generation)
        return key.to_dict(), nbytes, len(shards)

    def _dead(self, job: Job, attempts: int, err: str) -> None:
        self.registry.update(job.tenant, job.doc, status="failed", stage="failed", error=err)
        self.queue.dead_letter(job, attempts, err)
        self.metrics.builds.labels("dead_letter").inc()
        log.error("build of %s/%s dead-lettered after %d attempts: %s", job.tenant, job.doc, attempts, err)

    def _heartbeat(self, job: Job, done: threading.Event) -> None:
        every = max(0.2, self.s.claim_idle_s / 4)
        while not done.wait(every):
            try:
                self.queue.heartbeat(self.s.consumer, job)
            except Exception as e:     # noqa: BLE001 - a missed beat only risks a duplicate build (idempotent)
                log.warning("heartbeat failed: %s", e)
