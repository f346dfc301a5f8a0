"""The Redis index: generation pointers, manifests, uploads in progress, blob reference counts.

Every key of one document shares the Redis Cluster hash tag `{<tenant>/<doc_id>}`, so each multi-key step
below (begin, mark received, commit, retire, GC mark, and the reads of an upload, a manifest, a state) is one
Lua script on one slot: atomic on a single Redis and unchanged on Redis Cluster (no MULTI/WATCH: one round
trip, and redis-py's asyncio cluster pipelines are not needed). Per-tenant listing keys (tag `{<tenant>}`) are
written before a document's first commit and only ever hint; a document is listed only when it has a readable
generation.

Blobs are content-addressed *within* a document (blob.py: tenant/doc_id/digest), never shared between
documents, so every reference to a blob (a readable generation's `refs`, an open upload's `pins`, GC's
`deleting` claim) lives on its document's slot, and "GC deletes only unreferenced blobs" is decided by one
script on that slot. Sharing a blob between documents would put its references on several slots and need a
GC that checks all of them under a cross-slot ordering; it would save little, since two documents' artifacts
differ unless their tokens, checkpoint, profile and TP size all agree, which makes them one document.

Per document (prefix P, tag T):
    P:T:doc            hash   key (msgpack), current (generation), hwm (highest generation begun)
    P:T:gens           zset   readable (committed, not retired) generations
    P:T:retired        set    retired generations (never reused)
    P:T:gen:<g>        hash   manifest (shard table bytes), digests (space separated, distinct), at (ms)
    P:T:up:<id>        hash   gen, n, shards (declared table), digests; expires with the upload
    P:T:up:<id>:recv   set    "rank/name" of shards stored and verified
    P:T:refs           hash   digest -> number of readable generations referencing it
    P:T:pins           hash   digest -> number of open uploads declaring it
    P:T:uploads        zset   open upload ids by expiry (ms); P:T:updigests hash: upload id -> its digests
    P:T:deleting       set    digests GC has claimed; puts and commits of them wait
    P:T:gclock         string GC mutual exclusion per document
Per tenant: P:{tenant}:docs (set of doc ids), P:{tenant}:byhash:<doc_hash> (set of doc ids)."""
from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .errors import AlreadyExists, DataLoss, FailedPrecondition, NotFound, Unavailable
from .keys import MAX_GENERATION, DocumentKey, Manifest, ShardSpec


def index_outage(err: BaseException) -> Unavailable | None:
    """An index connection failure as the domain error (UNAVAILABLE), for the transports; else None."""
    if isinstance(err, (RedisConnectionError, RedisTimeoutError)):
        return Unavailable(f"index unavailable: {err}")
    return None


_BEGIN = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local g = tonumber(ARGV[1])
local hwm = tonumber(redis.call('HGET', KEYS[1], 'hwm') or '0')
if g == 0 then g = hwm + 1 end
if g > tonumber(ARGV[8]) then return {-2, g} end
if redis.call('ZSCORE', KEYS[2], g) or redis.call('SISMEMBER', KEYS[3], g) == 1 then return {-1, g} end
if g > hwm then redis.call('HSET', KEYS[1], 'hwm', g) end
redis.call('HSETNX', KEYS[1], 'key', ARGV[3])
local expires = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[4], 'gen', g, 'n', ARGV[4], 'shards', ARGV[5], 'digests', ARGV[6], 'key', ARGV[3])
redis.call('PEXPIREAT', KEYS[4], expires)
redis.call('ZADD', KEYS[7], expires, ARGV[7])
redis.call('HSET', KEYS[8], ARGV[7], ARGV[6])
local out = {g, expires}
for d in string.gmatch(ARGV[6], '%S+') do
  redis.call('HINCRBY', KEYS[5], d, 1)
  if redis.call('SISMEMBER', KEYS[6], d) == 1 then table.insert(out, d) end
end
return out
"""
# KEYS: doc, gens, retired, up, pins, deleting, uploads, updigests
# ARGV: generation (0: allocate), ttl_ms, key, n, shards, digests, upload id, highest generation
# (the caller checked an explicit generation against it; here it bounds allocation, before anything is written)

_RECEIVED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local m = tonumber(ARGV[1])
for i = m + 2, #ARGV do
  if redis.call('SISMEMBER', KEYS[3], ARGV[i]) == 1 then return -2 end
end
for i = 2, m + 1, 4096 do
  redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 4095, m + 1)))
end
redis.call('PEXPIREAT', KEYS[2], redis.call('PEXPIRETIME', KEYS[1]))
return 1
"""
# KEYS: up, recv, deleting; ARGV: number of members, members..., their distinct digests...
# (SADD in slices: unpack of more values than Lua's C stack holds fails)

_COMMIT = """
if redis.call('EXISTS', KEYS[4]) == 0 then return {-1} end
local g = tonumber(redis.call('HGET', KEYS[4], 'gen'))
if g ~= tonumber(ARGV[1]) then return {-3, g} end
if redis.call('ZSCORE', KEYS[2], g) or redis.call('SISMEMBER', KEYS[3], g) == 1 then return {-2, g} end
local n = tonumber(redis.call('HGET', KEYS[4], 'n'))
local have = redis.call('SCARD', KEYS[5])
if have ~= n then return {-4, have, n} end
local digests = redis.call('HGET', KEYS[4], 'digests')
for d in string.gmatch(digests, '%S+') do
  if redis.call('SISMEMBER', KEYS[8], d) == 1 then return {-5, d} end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[6], 'manifest', ARGV[2], 'digests', digests, 'at', now)
for d in string.gmatch(digests, '%S+') do redis.call('HINCRBY', KEYS[7], d, 1) end
redis.call('ZADD', KEYS[2], g, g)
local cur = tonumber(redis.call('HGET', KEYS[1], 'current') or '0')
local became = 0
if g > cur then
  redis.call('HSET', KEYS[1], 'current', g)
  cur = g
  became = 1
end
redis.call('DEL', KEYS[4], KEYS[5])
if redis.call('HDEL', KEYS[10], ARGV[3]) == 1 then
  redis.call('ZREM', KEYS[9], ARGV[3])
  for d in string.gmatch(digests, '%S+') do
    if redis.call('HINCRBY', KEYS[11], d, -1) <= 0 then redis.call('HDEL', KEYS[11], d) end
  end
end
return {1, became, cur, now}
"""
# KEYS: doc, gens, retired, up, recv, gen:g, refs, deleting, uploads, updigests, pins; ARGV: g, manifest, upload id

_RETIRE = """
local g = tonumber(ARGV[1])
if not redis.call('ZSCORE', KEYS[2], g) then
  if redis.call('SISMEMBER', KEYS[3], g) == 1 then return {-2} end
  return {-1}
end
local digests = redis.call('HGET', KEYS[4], 'digests') or ''
for d in string.gmatch(digests, '%S+') do
  if redis.call('HINCRBY', KEYS[5], d, -1) <= 0 then redis.call('HDEL', KEYS[5], d) end
end
redis.call('DEL', KEYS[4])
redis.call('ZREM', KEYS[2], g)
redis.call('SADD', KEYS[3], g)
local cur = tonumber(redis.call('HGET', KEYS[1], 'current') or '0')
if cur == g then
  local top = redis.call('ZREVRANGE', KEYS[2], 0, 0)
  cur = tonumber(top[1] or '0')
  redis.call('HSET', KEYS[1], 'current', cur)
end
return {1, cur}
"""
# KEYS: doc, gens, retired, gen:g, refs; ARGV: g

_GC_MARK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)) do
  local digests = redis.call('HGET', KEYS[5], id) or ''
  for d in string.gmatch(digests, '%S+') do
    if redis.call('HINCRBY', KEYS[2], d, -1) <= 0 then redis.call('HDEL', KEYS[2], d) end
  end
  redis.call('HDEL', KEYS[5], id)
  redis.call('ZREM', KEYS[4], id)
end
local marked = {}
for i = 1, #ARGV do
  local d = ARGV[i]
  if redis.call('HEXISTS', KEYS[1], d) == 0 and redis.call('HEXISTS', KEYS[2], d) == 0 then
    redis.call('SADD', KEYS[3], d)
    table.insert(marked, d)
  end
end
return marked
"""
# KEYS: refs, pins, deleting, uploads, updigests; ARGV: candidate digests
# (expired uploads release their pins here: an upload's key expires by itself, its pins only when reaped)

# Reads of several keys are scripts too, not MULTI/WATCH: one round trip, atomic, and on one slot by construction.
_READ_UPLOAD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
local h = redis.call('HMGET', KEYS[1], 'gen', 'shards', 'key')
return {h[1], h[2], h[3], redis.call('SMEMBERS', KEYS[2])}
"""
# KEYS: up, recv

_READ_MANIFEST = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'current') or '0')
if ARGV[1] == '0' and cur ~= tonumber(ARGV[2]) then return {-1, cur} end
local h = redis.call('HMGET', KEYS[3], 'manifest', 'at')
return {cur, h[1], h[2], redis.call('ZRANGE', KEYS[2], 0, -1)}
"""
# KEYS: doc, gens, gen:g; ARGV: generation asked (0: current), g (the current one read before, when 0 was asked)

_READ_STATE = """
local h = redis.call('HMGET', KEYS[1], 'key', 'current')
return {h[1], h[2], redis.call('ZRANGE', KEYS[2], 0, -1)}
"""
# KEYS: doc, gens

_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


LARGE_ENTRY = 64 << 10          # entries larger than this (~500 shards) are parsed in a thread, off the event loop


async def _off_loop(size: int, fn, *args):
    return await asyncio.to_thread(fn, *args) if size > LARGE_ENTRY else fn(*args)


@contextlib.contextmanager
def _entry(what: str):
    """Parsing an index entry: one that does not parse was altered or corrupted, which is DataLoss (a reader falls
    back with digest_mismatch), not an internal error and not store_unavailable."""
    try:
        yield
    except (DataLoss, NotFound):
        raise
    except Exception as e:      # noqa: BLE001 - whatever msgpack or int() make of a corrupt entry
        raise DataLoss(f"the index's {what} is corrupt ({type(e).__name__}: {e})"[:500]) from None


@dataclass(frozen=True)
class Upload:
    upload_id: str
    tenant: str
    doc_id: str
    key: DocumentKey
    generation: int
    shards: tuple[ShardSpec, ...]
    received: frozenset[tuple[int, str]]


@dataclass(frozen=True)
class DocState:
    key: DocumentKey
    current: int
    generations: tuple[int, ...]


def upload_id_parts(upload_id: str) -> tuple[str, str]:
    """An upload id is `<doc_id>.<random>`: the document (hence the hash tag) is recoverable from it."""
    doc_id, _, rand = upload_id.partition(".")
    return doc_id, rand


class RedisIndex:
    def __init__(self, client: aioredis.Redis, prefix: str = "redknot"):
        self.r, self.prefix = client, prefix
        self._begin = client.register_script(_BEGIN)
        self._received = client.register_script(_RECEIVED)
        self._commit = client.register_script(_COMMIT)
        self._retire = client.register_script(_RETIRE)
        self._gc_mark = client.register_script(_GC_MARK)
        self._unlock = client.register_script(_UNLOCK)
        self._read_upload = client.register_script(_READ_UPLOAD)
        self._read_manifest = client.register_script(_READ_MANIFEST)
        self._read_state = client.register_script(_READ_STATE)

    # ------------------------------------------------------------------------------------------------ keys
    def k(self, tenant: str, doc_id: str, *rest: str | int) -> str:
        return ":".join([f"{self.prefix}:{{{tenant}/{doc_id}}}", *map(str, rest)])

    def tk(self, tenant: str, *rest: str) -> str:
        return ":".join([f"{self.prefix}:{{{tenant}}}", *rest])

    # ------------------------------------------------------------------------------------------- writing
    async def begin(self, tenant: str, key: DocumentKey, generation: int, shards: list[ShardSpec],
                    ttl_ms: int) -> tuple[int, str, int, set[str]]:
        """Open an upload; returns (generation, upload_id, expires_at_ms, digests being collected)."""
        doc_id = key.doc_id
        upload_id = f"{doc_id}.{uuid.uuid4().hex}"
        digests = sorted({s.digest for s in shards})
        # listing hints first: a crash after them lists nothing (no readable generation), never hides a commit
        # (written only where missing, so a Begin that the script refuses, on a known document, writes nothing)
        hints = [self.tk(tenant, "docs"), self.tk(tenant, "byhash", key.doc_hash)]
        async with self.r.pipeline(transaction=False) as p:
            for h in hints:
                p.sismember(h, doc_id)
            missing = [h for h, there in zip(hints, await p.execute()) if not there]
        if missing:
            async with self.r.pipeline(transaction=False) as p:
                for h in missing:
                    p.sadd(h, doc_id)
                await p.execute()
        _, up, _ = self._up(tenant, upload_id)
        res = await self._begin(
            keys=[self.k(tenant, doc_id, "doc"), self.k(tenant, doc_id, "gens"), self.k(tenant, doc_id, "retired"),
                  up, self.k(tenant, doc_id, "pins"), self.k(tenant, doc_id, "deleting"),
                  self.k(tenant, doc_id, "uploads"), self.k(tenant, doc_id, "updigests")],
            args=[generation, ttl_ms, msgpack.packb(key.to_dict()), len(shards),
                  msgpack.packb([s.to_list() for s in shards]), " ".join(digests), upload_id, MAX_GENERATION])
        if res[0] == -1:
            raise AlreadyExists(f"generation {res[1]} of this document is already committed or retired")
        if res[0] == -2:
            raise FailedPrecondition(f"this document has used every generation up to {MAX_GENERATION}; name a free "
                                     f"one below it")
        return int(res[0]), upload_id, int(res[1]), {d.decode() if isinstance(d, bytes) else d for d in res[2:]}

    def _up(self, tenant: str, upload_id: str) -> tuple[str, str, str]:
        doc_id, rand = upload_id_parts(upload_id)
        return doc_id, self.k(tenant, doc_id, "up", rand), self.k(tenant, doc_id, "up", rand, "recv")

    async def upload(self, tenant: str, upload_id: str) -> Upload:
        doc_id, up, recv = self._up(tenant, upload_id)
        res = await self._read_upload(keys=[up, recv])
        if not res:
            raise NotFound(f"upload {upload_id!r} is unknown, expired or already committed")

        def parse() -> Upload:
            with _entry(f"upload {upload_id}"):
                gen, shards, key, received = res
                specs = tuple(ShardSpec.from_list(s) for s in msgpack.unpackb(shards, raw=False))
                got = set()
                for m in received:
                    rank, _, name = m.decode().partition("/")
                    got.add((int(rank), name))
                return Upload(upload_id, tenant, doc_id, DocumentKey.from_dict(msgpack.unpackb(key, raw=False)),
                              int(gen), specs, frozenset(got))
        return await _off_loop(len(res[1] or b""), parse)

    async def mark_received(self, tenant: str, upload_id: str, specs: list[ShardSpec]) -> None:
        """Record shards as stored and verified: one script for all of them (a Begin may deduplicate 16k)."""
        if not specs:
            return
        doc_id, up, recv = self._up(tenant, upload_id)
        digests = sorted({s.digest for s in specs})
        res = await self._received(keys=[up, recv, self.k(tenant, doc_id, "deleting")],
                                   args=[len(specs), *(f"{s.rank}/{s.name}" for s in specs), *digests])
        if res == -1:
            raise NotFound(f"upload {upload_id!r} expired or was committed while shard {specs[0].name!r} was stored")
        if res == -2:
            raise Unavailable(f"a blob of {specs[0].name!r} is being garbage-collected; retry the shard")

    async def is_deleting(self, tenant: str, doc_id: str, digest: str) -> bool:
        return bool(await self.r.sismember(self.k(tenant, doc_id, "deleting"), digest))

    async def commit(self, tenant: str, upload: Upload, manifest: Manifest) -> tuple[bool, int, int]:
        """Atomically publish `manifest`; returns (became_current, current, committed_at_ms)."""
        t, d = tenant, upload.doc_id
        _, up, recv = self._up(tenant, upload.upload_id)
        res = await self._commit(
            keys=[self.k(t, d, "doc"), self.k(t, d, "gens"), self.k(t, d, "retired"), up, recv,
                  self.k(t, d, "gen", upload.generation), self.k(t, d, "refs"), self.k(t, d, "deleting"),
                  self.k(t, d, "uploads"), self.k(t, d, "updigests"), self.k(t, d, "pins")],
            args=[upload.generation, manifest.shard_table_bytes(), upload.upload_id])
        code = res[0]
        if code == -1:
            raise NotFound(f"upload {upload.upload_id!r} is unknown, expired or already committed")
        if code == -2:
            raise AlreadyExists(f"generation {res[1]} of this document is already committed or retired")
        if code == -4:
            raise FailedPrecondition(f"{res[1]} of {res[2]} declared shards are stored; commit needs all of them")
        if code == -5:
            raise Unavailable(f"blob {res[1]!r} is being garbage-collected; re-upload it and commit again")
        assert code == 1, res
        return bool(res[1]), int(res[2]), int(res[3])

    async def retire(self, tenant: str, key: DocumentKey, generation: int) -> int:
        t, d = tenant, key.doc_id
        res = await self._retire(keys=[self.k(t, d, "doc"), self.k(t, d, "gens"), self.k(t, d, "retired"),
                                       self.k(t, d, "gen", generation), self.k(t, d, "refs")], args=[generation])
        if res[0] == -1:
            raise NotFound(f"generation {generation} is not a readable generation of this document")
        if res[0] == -2:
            raise NotFound(f"generation {generation} is already retired")
        return int(res[1])

    # ------------------------------------------------------------------------------------------- reading
    async def manifest(self, tenant: str, key: DocumentKey, generation: int) -> tuple[Manifest, int, tuple[int, ...]]:
        """A consistent (manifest, current, readable generations): one script reads the pointer and the manifest,
        so a concurrent commit or retire can never pair a pointer with another manifest. Asked for the current
        generation, it is read first (the manifest's key names it) and the script retries if it moved meanwhile."""
        d = key.doc_id
        doc, gens = self.k(tenant, d, "doc"), self.k(tenant, d, "gens")
        with _entry("current generation"):
            cur = 0 if generation else int(await self.r.hget(doc, "current") or 0)
        for _ in range(16):
            g = generation or cur
            if g == 0:
                raise NotFound("this document has no readable generation")
            res = await self._read_manifest(keys=[doc, gens, self.k(tenant, d, "gen", g)], args=[generation, g])
            if res[0] == -1:
                cur = int(res[1])               # a commit or retire moved the pointer between the two reads
                continue
            if res[1] is None:
                raise NotFound(f"generation {g} is not a readable generation of this document")
            with _entry(f"generation {g}"):
                cur, raw, at, readable = int(res[0]), res[1], int(res[2]), [int(x) for x in res[3]]
            m = await _off_loop(len(raw), Manifest.from_bytes, raw, at, f"manifest of generation {g}")
            if m.key != key:
                raise NotFound("no such document")        # a doc_id collision would land here; never serve it
            return m, cur, tuple(readable)
        raise Unavailable("the document changed 16 times while its manifest was read; retry")

    async def doc_state(self, tenant: str, doc_id: str) -> DocState | None:
        raw, cur, gens = await self._read_state(keys=[self.k(tenant, doc_id, "doc"), self.k(tenant, doc_id, "gens")])
        if raw is None or not gens:
            return None
        with _entry(f"document {doc_id}"):
            return DocState(DocumentKey.from_dict(msgpack.unpackb(raw, raw=False)).check(), int(cur or 0),
                            tuple(int(g) for g in gens))

    async def list_doc_ids(self, tenant: str, cursor: int, count: int, doc_hash: str = "") -> tuple[int, list[str]]:
        key = self.tk(tenant, "byhash", doc_hash) if doc_hash else self.tk(tenant, "docs")
        cursor, ids = await self.r.sscan(key, cursor=cursor, count=count)
        return int(cursor), sorted(i.decode() for i in ids)

    async def all_doc_ids(self, tenant: str) -> list[str]:
        return sorted(i.decode() for i in await self.r.smembers(self.tk(tenant, "docs")))

    # ------------------------------------------------------------------------------------------------ GC
    async def gc_lock(self, tenant: str, doc_id: str, ttl_ms: int) -> str | None:
        token = uuid.uuid4().hex
        ok = await self.r.set(self.k(tenant, doc_id, "gclock"), token, nx=True, px=ttl_ms)
        return token if ok else None

    async def gc_unlock(self, tenant: str, doc_id: str, token: str) -> None:
        await self._unlock(keys=[self.k(tenant, doc_id, "gclock")], args=[token])

    async def gc_leftovers(self, tenant: str, doc_id: str) -> list[str]:
        """Digests a crashed GC had claimed; still unreferenced (nothing can reference a claimed digest)."""
        return sorted(d.decode() for d in await self.r.smembers(self.k(tenant, doc_id, "deleting")))

    async def gc_mark(self, tenant: str, doc_id: str, candidates: list[str]) -> list[str]:
        t, d = tenant, doc_id
        res = await self._gc_mark(keys=[self.k(t, d, "refs"), self.k(t, d, "pins"), self.k(t, d, "deleting"),
                                        self.k(t, d, "uploads"), self.k(t, d, "updigests")], args=candidates)
        return [x.decode() if isinstance(x, bytes) else x for x in res]

    async def gc_unmark(self, tenant: str, doc_id: str, digests: list[str]) -> None:
        if digests:
            await self.r.srem(self.k(tenant, doc_id, "deleting"), *digests)

    async def referenced(self, tenant: str, doc_id: str) -> set[str]:
        return {d.decode() for d in await self.r.hkeys(self.k(tenant, doc_id, "refs"))}
