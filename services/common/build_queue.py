"""The build queue: a Redis Stream read by a consumer group, at least once.

    P:{queue}:builds           stream of {tenant, doc}; the registry's upload script appends to it
    P:{queue}:builds:delayed   sorted set of retries by due time (ms); promoted into the stream when due
    P:{queue}:builds:dead      stream of jobs that failed every attempt, with their last error
Every key shares the Redis Cluster hash tag `{queue}` with the registry's records, so each transaction below and
the registry's upload script stay on one slot.
An entry is acknowledged (and deleted) only after its document is committed to the store and marked ready, or
after it moved to the retry set or the dead-letter stream in the same transaction. A builder that dies leaves
its entry pending: it reads its own pending entries again when it restarts, and any builder claims entries
that stayed idle past `claim_idle_ms` (a working builder keeps its entry's idle time near zero: heartbeat)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis

GROUP = "builders"

# KEYS: delayed, stream. ARGV: now_ms, limit. Move due retries into the stream.
_PROMOTE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, m in ipairs(due) do
  local j = cjson.decode(m)
  redis.call('XADD', KEYS[2], '*', 'tenant', j.tenant, 'doc', j.doc, 'attempt', tostring(j.attempt))
  redis.call('ZREM', KEYS[1], m)
end
return #due
"""


def queue_tag(prefix: str) -> str:
    """The key prefix of the queue and the registry's records: one hash tag, hence one Redis Cluster slot."""
    return f"{prefix}:{{queue}}"


def stream_key(prefix: str) -> str:
    return f"{queue_tag(prefix)}:builds"


@dataclass(frozen=True)
class Job:
    entry_id: str
    tenant: str
    doc: str


class BuildQueue:
    def __init__(self, r: redis.Redis, prefix: str, claim_idle_ms: int = 60_000):
        self.r = r
        self.stream = stream_key(prefix)
        self.delayed = f"{self.stream}:delayed"
        self.dead = f"{self.stream}:dead"
        self.claim_idle_ms = claim_idle_ms
        self._promote = r.register_script(_PROMOTE)

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    @staticmethod
    def _job(entry_id, fields) -> Job | None:
        if not fields:                      # deleted while pending
            return None
        f = {k.decode(): v.decode() for k, v in fields.items()}
        return Job(entry_id.decode() if isinstance(entry_id, bytes) else entry_id, f["tenant"], f["doc"])

    def _first(self, entries) -> Job | None:
        for entry_id, fields in entries:
            job = self._job(entry_id, fields)
            if job is not None:
                return job
            self.r.xack(self.stream, GROUP, entry_id)        # an entry deleted while pending: drop it
        return None

    def claim(self, consumer: str, block_ms: int = 1000) -> Job | None:
        """The next job for `consumer`: its own pending entries first (it crashed holding them), then entries
        other builders left idle too long, then new ones (blocking up to `block_ms`)."""
        self.promote_due()
        own = self.r.xreadgroup(GROUP, consumer, {self.stream: "0"}, count=1)
        job = self._first(own[0][1] if own else [])
        if job is None:
            job = self._first(self.r.xautoclaim(self.stream, GROUP, consumer, self.claim_idle_ms, "0-0", count=1)[1])
        if job is None:
            new = self.r.xreadgroup(GROUP, consumer, {self.stream: ">"}, count=1, block=block_ms)
            job = self._first(new[0][1] if new else [])
        return job

    def heartbeat(self, consumer: str, job: Job) -> None:
        """Reset the entry's idle time so no other builder claims a job that is still running."""
        self.r.xclaim(self.stream, GROUP, consumer, 0, [job.entry_id], justid=True)

    def done(self, job: Job) -> None:
        with self.r.pipeline(transaction=True) as p:
            p.xack(self.stream, GROUP, job.entry_id)
            p.xdel(self.stream, job.entry_id)
            p.execute()

    def retry(self, job: Job, attempt: int, delay_s: float) -> None:
        due = int((time.time() + delay_s) * 1000)
        member = json.dumps({"tenant": job.tenant, "doc": job.doc, "attempt": attempt, "from": job.entry_id})
        with self.r.pipeline(transaction=True) as p:
            p.zadd(self.delayed, {member: due})
            p.xack(self.stream, GROUP, job.entry_id)
            p.xdel(self.stream, job.entry_id)
            p.execute()

    def dead_letter(self, job: Job, attempts: int, error: str) -> None:
        with self.r.pipeline(transaction=True) as p:
            p.xadd(self.dead, {"tenant": job.tenant, "doc": job.doc, "attempts": attempts, "error": error[:2000],
                               "entry": job.entry_id}, maxlen=10_000, approximate=True)
            p.xack(self.stream, GROUP, job.entry_id)
            p.xdel(self.stream, job.entry_id)
            p.execute()

    def promote_due(self) -> int:
        return int(self._promote(keys=[self.delayed, self.stream], args=[int(time.time() * 1000), 100]))

    def depth(self) -> int:
        """Jobs not done: undelivered, delivered but not acknowledged, and waiting to be retried."""
        undelivered, pending = 0, 0
        for g in self.r.xinfo_groups(self.stream):
            if g["name"] in (GROUP, GROUP.encode()):
                pending = int(g["pending"])
                lag = g.get("lag")
                if lag is None:         # not computable after some deletions: count what follows last delivery
                    last = g["last-delivered-id"]
                    last = last.decode() if isinstance(last, bytes) else last
                    lag = len(self.r.xrange(self.stream, f"({last}", "+", count=100_000))
                undelivered = int(lag)
        return undelivered + pending + int(self.r.zcard(self.delayed))

    def dead_letters(self, count: int = 100) -> list[dict]:
        return [{k.decode(): v.decode() for k, v in f.items()} | {"id": i.decode()}
                for i, f in self.r.xrange(self.dead, count=count)]
