"""The document registry in Redis: what each tenant uploaded, its tokens, its build status and generations.

Keys under the prefix P (a document's keys carry its tenant, so no call can reach another tenant's):
    P:{queue}:doc:<tenant>:<id>    hash: the record below
    P:{queue}:docs:<tenant>        sorted set: ids by creation time (listing, paging)
    P:tokens:{<tenant>/<id>}       string: the token ids, int32 little-endian
An upload creates the record and enqueues the build in ONE Lua script, so an upload that was acknowledged is
always queued and a crash can never leave a record that no build will pick up. That script writes the build
stream too, so records share the queue's Redis Cluster hash tag `{queue}` (build_queue.py): one slot holds the
registry and the queue, whose load is a few small writes per upload and per build. The tokens, the only large
values, are written just before that script, on the document's own slot: the id is the hash of the tokens, so
what an id's key holds never changes and writing it first (SET NX) is safe; a record never exists without its
tokens, and a crash between the two leaves tokens that the next upload of the same content finds."""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import redis

from .build_queue import queue_tag, stream_key

STATUSES = ("queued", "building", "ready", "failed", "retired")

# KEYS: doc, docs, stream. ARGV: id, tenant, n_tokens, source, now_ms.
# New document: create, enqueue, return {1, "new"}. Retired or failed: build again (a retired one under a new
# generation: retired numbers are never reused), return {1, old status}. Otherwise nothing changes: {0, status}.
_CREATE = """
local status = redis.call('HGET', KEYS[1], 'status')
if status then
  if status ~= 'retired' and status ~= 'failed' then return {0, status} end
  local target = tonumber(redis.call('HGET', KEYS[1], 'target_generation'))
  if status == 'retired' then
    for _, g in ipairs(cjson.decode(redis.call('HGET', KEYS[1], 'retired'))) do
      if g >= target then target = g + 1 end
    end
  end
  redis.call('HSET', KEYS[1], 'status', 'queued', 'stage', 'queued', 'progress', '0', 'attempts', '0',
             'error', '', 'target_generation', tostring(target), 'updated_ms', ARGV[5])
  redis.call('XADD', KEYS[3], '*', 'tenant', ARGV[2], 'doc', ARGV[1])
  return {1, status}
end
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'tenant', ARGV[2], 'status', 'queued', 'stage', 'queued',
           'progress', '0', 'n_tokens', ARGV[3], 'source', ARGV[4], 'created_ms', ARGV[5], 'updated_ms', ARGV[5],
           'attempts', '0', 'error', '', 'generation', '0', 'target_generation', '1', 'generations', '[]',
           'retired', '[]', 'key', '', 'bytes', '0', 'shards', '0', 'build_s', '0')
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
redis.call('XADD', KEYS[3], '*', 'tenant', ARGV[2], 'doc', ARGV[1])
return {1, 'new'}
"""

# KEYS: doc. ARGV: generation, key json, bytes, shards, build_s, now_ms. Only a record that exists and is not
# retired becomes ready; the generation joins the committed list once.
_READY = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'retired' then return 0 end
local gens = cjson.decode(redis.call('HGET', KEYS[1], 'generations'))
local g = tonumber(ARGV[1])
local seen = false
for _, x in ipairs(gens) do if x == g then seen = true end end
if not seen then table.insert(gens, g) end
table.sort(gens)
redis.call('HSET', KEYS[1], 'status', 'ready', 'stage', 'ready', 'progress', '1', 'error', '',
           'generation', ARGV[1], 'generations', cjson.encode(gens), 'key', ARGV[2], 'bytes', ARGV[3],
           'shards', ARGV[4], 'build_s', ARGV[5], 'updated_ms', ARGV[6])
return 1
"""

# KEYS: doc. ARGV: generation, now_ms. The generation moves to the retired list; nothing is current after it.
_RETIRED = """
if not redis.call('HGET', KEYS[1], 'status') then return 0 end
local gens = cjson.decode(redis.call('HGET', KEYS[1], 'generations'))
local retired = cjson.decode(redis.call('HGET', KEYS[1], 'retired'))
local g = tonumber(ARGV[1])
local keep = {}
for _, x in ipairs(gens) do if x ~= g then table.insert(keep, x) end end
local seen = false
for _, x in ipairs(retired) do if x == g then seen = true end end
if not seen and g > 0 then table.insert(retired, g) end
redis.call('HSET', KEYS[1], 'status', 'retired', 'stage', 'retired', 'generation', '0',
           'generations', cjson.encode(keep), 'retired', cjson.encode(retired), 'updated_ms', ARGV[2])
return 1
"""

# KEYS: doc, stream. ARGV: tenant, id, broken generation, reason, now_ms. A ready document whose current generation
# is the broken one is queued for a build under a new generation (above every retired one); return 1. Anything else
# (not ready, another generation current, a rebuild already queued): nothing changes, return 0.
_REBUILD = """
if redis.call('HGET', KEYS[1], 'status') ~= 'ready' then return 0 end
local broken = tonumber(ARGV[3])
if tonumber(redis.call('HGET', KEYS[1], 'generation')) ~= broken then return 0 end
local target = tonumber(redis.call('HGET', KEYS[1], 'target_generation'))
if target > broken then return 0 end
target = broken + 1
for _, g in ipairs(cjson.decode(redis.call('HGET', KEYS[1], 'retired'))) do
  if g >= target then target = g + 1 end
end
redis.call('HSET', KEYS[1], 'status', 'queued', 'stage', 'rebuild: ' .. ARGV[4], 'progress', '0', 'attempts', '0',
           'error', '', 'target_generation', tostring(target), 'updated_ms', ARGV[5])
redis.call('XADD', KEYS[2], '*', 'tenant', ARGV[1], 'doc', ARGV[2])
return 1
"""

# KEYS: doc. ARGV: field, value, ... Set fields of a record that exists; never create one.
_UPDATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


class CorruptRecord(ValueError):
    """A document's record or its tokens in Redis cannot be read (a field missing or unparsable, the tokens key
    deleted or truncated): that one document cannot be served; others are unaffected. Callers report it for that
    document (the API: 409 with this message; the builder: a failed attempt)."""


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class DocumentRecord:
    id: str
    tenant: str
    status: str
    stage: str
    progress: float
    n_tokens: int
    source: str
    created_ms: int
    updated_ms: int
    attempts: int
    error: str
    generation: int                 # current committed generation; 0: none (not built yet, failed or retired)
    target_generation: int          # the generation the pending build commits
    generations: list[int] = field(default_factory=list)
    retired: list[int] = field(default_factory=list)
    key: dict | None = None         # the store key (services.store.keys.DocumentKey.to_dict()) once built
    bytes: int = 0                  # stored bytes over every rank's shards
    shards: int = 0
    build_s: float = 0.0

    @staticmethod
    def from_hash(h: dict[bytes, bytes]) -> "DocumentRecord":
        """The record of a hash; CorruptRecord when a field is missing or does not parse."""
        try:
            d = {k.decode(): v.decode() for k, v in h.items()}
            rec = DocumentRecord(
                id=d["id"], tenant=d["tenant"], status=d["status"], stage=d["stage"], progress=float(d["progress"]),
                n_tokens=int(d["n_tokens"]), source=d["source"], created_ms=int(d["created_ms"]),
                updated_ms=int(d["updated_ms"]), attempts=int(d["attempts"]), error=d["error"],
                generation=int(d["generation"]), target_generation=int(d["target_generation"]),
                # Redis's cjson writes an empty Lua table as {}: read it as the empty list it is
                generations=list(json.loads(d["generations"]) or []), retired=list(json.loads(d["retired"]) or []),
                key=json.loads(d["key"]) if d["key"] else None, bytes=int(d["bytes"]), shards=int(d["shards"]),
                build_s=float(d["build_s"]))
        except KeyError as e:
            raise CorruptRecord(f"field {e.args[0]!r} is missing") from None
        except (ValueError, TypeError) as e:        # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CorruptRecord(f"a field does not parse: {type(e).__name__}: {str(e)[:120]}") from None
        rec._check()
        return rec

    def _check(self) -> None:
        def ints(xs) -> bool:
            return all(type(x) is int for x in xs)
        problems = [what for what, ok in (
            ("status", self.status in STATUSES), ("source", self.source in ("text", "tokens")),
            ("progress", 0.0 <= self.progress <= 1.0), ("n_tokens", self.n_tokens >= 0),
            ("generation", self.generation >= 0), ("generations", ints(self.generations)),
            ("retired", ints(self.retired)), ("key", self.key is None or isinstance(self.key, dict)),
            ("build_s", math.isfinite(self.build_s))) if not ok]
        if problems:
            raise CorruptRecord(f"bad value of {', '.join(problems)}")

    def to_dict(self) -> dict:
        return asdict(self)


class Registry:
    def __init__(self, r: redis.Redis, prefix: str):
        self.r, self.prefix = r, prefix
        self.stream = stream_key(prefix)
        self._create = r.register_script(_CREATE)
        self._ready = r.register_script(_READY)
        self._retired = r.register_script(_RETIRED)
        self._update = r.register_script(_UPDATE)
        self._rebuild = r.register_script(_REBUILD)

    def _doc(self, tenant: str, doc_id: str) -> str:
        return f"{queue_tag(self.prefix)}:doc:{tenant}:{doc_id}"

    def _tokens(self, tenant: str, doc_id: str) -> str:
        return f"{self.prefix}:tokens:{{{tenant}/{doc_id}}}"

    def _docs(self, tenant: str) -> str:
        return f"{queue_tag(self.prefix)}:docs:{tenant}"

    # ------------------------------------------------------------------------------------------------ api
    def create(self, tenant: str, doc_id: str, tokens: list[int], source: str) -> tuple[DocumentRecord, bool]:
        """Create and enqueue, or find. Returns (record, whether a build was enqueued)."""
        self.r.set(self._tokens(tenant, doc_id), np.asarray(tokens, dtype="<i4").tobytes(), nx=True)
        queued, _ = self._create(keys=[self._doc(tenant, doc_id), self._docs(tenant), self.stream],
                                 args=[doc_id, tenant, len(tokens), source, now_ms()])
        rec = self.get(tenant, doc_id)
        assert rec is not None, (tenant, doc_id)
        return rec, bool(queued)

    def get(self, tenant: str, doc_id: str) -> DocumentRecord | None:
        """The record, None when there is none; CorruptRecord when it cannot be read."""
        h = self.r.hgetall(self._doc(tenant, doc_id))
        if not h:
            return None
        try:
            return DocumentRecord.from_hash(h)
        except CorruptRecord as e:
            raise CorruptRecord(f"the record of document {doc_id} is unreadable: {e}") from None

    def tokens(self, tenant: str, doc_id: str) -> list[int]:
        """The document's token ids; CorruptRecord when the key is gone or its length is no whole number of ids."""
        raw = self.r.get(self._tokens(tenant, doc_id))
        if raw is None:
            raise CorruptRecord(f"document {doc_id} has a record but its tokens are missing")
        if len(raw) % 4:
            raise CorruptRecord(f"the tokens of document {doc_id} are truncated ({len(raw)} bytes)")
        return np.frombuffer(raw, dtype="<i4").tolist()

    def page_ids(self, tenant: str, offset: int, limit: int) -> tuple[list[str], int | None]:
        """Ids by creation time; the offset of the next page, or None at the end."""
        ids = self.r.zrange(self._docs(tenant), offset, offset + limit)      # one extra: is there a next page?
        return [i.decode() for i in ids[:limit]], (offset + limit if len(ids) > limit else None)

    def page(self, tenant: str, offset: int, limit: int) -> tuple[list[DocumentRecord], int | None]:
        """Documents by creation time; the offset of the next page, or None at the end."""
        ids, nxt = self.page_ids(tenant, offset, limit)
        recs = [self.get(tenant, i) for i in ids]
        return [r for r in recs if r is not None], nxt

    def count(self, tenant: str) -> int:
        return int(self.r.zcard(self._docs(tenant)))

    def mark_retired(self, tenant: str, doc_id: str, generation: int) -> None:
        self._retired(keys=[self._doc(tenant, doc_id)], args=[generation, now_ms()])

    def rebuild(self, tenant: str, doc_id: str, broken_generation: int, reason: str) -> bool:
        """Queue a ready document whose current generation `broken_generation` failed verification for a build
        under a new generation; False where nothing changed (not ready, another generation current, a rebuild
        already queued: many requests that meet one broken artifact queue one rebuild)."""
        return bool(self._rebuild(keys=[self._doc(tenant, doc_id), self.stream],
                                  args=[tenant, doc_id, broken_generation, reason, now_ms()]))

    # -------------------------------------------------------------------------------------------- builder
    def update(self, tenant: str, doc_id: str, **fields) -> None:
        """Progress fields of a record that exists (never creates one)."""
        pairs = [x for k, v in {**fields, "updated_ms": now_ms()}.items() for x in (k, str(v))]
        self._update(keys=[self._doc(tenant, doc_id)], args=pairs)

    def start_attempt(self, tenant: str, doc_id: str) -> int:
        key = self._doc(tenant, doc_id)
        with self.r.pipeline(transaction=True) as p:
            p.hincrby(key, "attempts", 1)
            p.hset(key, mapping={"status": "building", "stage": "starting", "progress": "0", "error": "",
                                 "updated_ms": now_ms()})
            n, _ = p.execute()
        return int(n)

    def mark_ready(self, tenant: str, doc_id: str, generation: int, key: dict, nbytes: int, shards: int,
                   build_s: float) -> bool:
        return bool(self._ready(keys=[self._doc(tenant, doc_id)],
                                args=[generation, json.dumps(key, sort_keys=True), nbytes, shards, f"{build_s:.3f}",
                                      now_ms()]))
