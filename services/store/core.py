"""The artifact store itself, transport-agnostic: begin, put, commit, read, validate, list, retire, collect.

Invariants:
- a generation is readable only after one atomic index step (index.commit) that finds every declared shard
  stored and verified; before it nothing of the generation is visible, after it all of it is;
- bytes are verified against their declared digest before they are published (write) and before the last
  chunk of a shard is released (read): a corrupt or truncated blob is never served whole, the call fails
  with DataLoss and `digest_failures` moves;
- every argument is checked before the first write, so a malformed request changes nothing;
- all state is scoped by the caller's tenant: no operation can name another tenant's document.
The gRPC adapter (grpc_service.py) converts messages to these calls; the HTTP API could do the same."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .blob import BlobBackend, BlobKey, BlobMissing, BlobUnavailable
from .errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, StoreError, Unavailable
from .index import RedisIndex, Upload
from .keys import (CHUNK_BYTES, MAX_INT64, DocumentKey, Limits, Manifest, Range, Reason, ShardKind, ShardSpec,
                   check_digest, check_generation, check_shard_table, covered, new_hasher, uncovered)
from .metrics import StoreMetrics

log = logging.getLogger("redknot.store")
_UPLOAD_ID = re.compile(r"^[0-9a-f]{32}\.[0-9a-f]{32}$")
_PAGE_TOKEN = re.compile(r"^(0|[1-9][0-9]{0,19})$")       # an SSCAN cursor: a uint64 in ASCII decimal
READ_AHEAD = 2                  # chunks a fetch stream reads ahead of what it has sent
INTACT_WORKERS = 8              # blobs BeginGeneration re-hashes at once before deduplicating them


# ------------------------------------------------------------------------------------------ params, results

@dataclass(frozen=True)
class BeginParams:
    key: DocumentKey
    generation: int                 # 0: allocate
    shards: tuple[ShardSpec, ...]


@dataclass(frozen=True)
class BeginResult:
    generation: int
    upload_id: str
    already_stored: tuple[tuple[int, str], ...]
    expires_at_unix_ms: int


@dataclass(frozen=True)
class PutChunk:
    upload_id: str
    rank: int
    name: str
    offset: int
    data: bytes
    last: bool


@dataclass(frozen=True)
class PutResult:
    stored: tuple[tuple[int, str], ...]
    bytes: int


@dataclass(frozen=True)
class CommitResult:
    manifest: Manifest
    became_current: bool
    current_generation: int


@dataclass(frozen=True)
class ManifestResult:
    manifest: Manifest
    current_generation: int
    generations: tuple[int, ...]


@dataclass(frozen=True)
class FetchParams:
    key: DocumentKey
    generation: int                 # 0: current, resolved once
    rank: int
    layers: Range | None = None
    channels: Range | None = None
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class FetchChunk:
    shard: ShardSpec | None         # on a shard's first chunk
    generation: int
    offset: int
    data: bytes
    last: bool


@dataclass(frozen=True)
class ValidateParams:
    key: DocumentKey
    rank: int
    channels: Range | None
    layers_needed: tuple[int, ...]
    generation: int
    certificate_digest: str
    deep: bool


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: Reason | None
    detail: str
    current_generation: int = 0
    certificate_digest: str = ""


@dataclass(frozen=True)
class DocumentSummary:
    key: DocumentKey
    current_generation: int
    generations: tuple[int, ...]


@dataclass(frozen=True)
class GcResult:
    blobs_deleted: int = 0
    bytes_freed: int = 0
    blobs_kept: int = 0
    temp_files_removed: int = 0


class _Spool:
    """One shard being received: a spool file, its running digest and byte count."""

    def __init__(self, spec: ShardSpec, directory: Path):
        self.spec, self.path, self.received = spec, directory / f"{uuid.uuid4().hex}.part", 0
        self.file = open(self.path, "wb", buffering=0)
        self.hasher = new_hasher()

    def write_blocking(self, data: bytes) -> None:
        self.file.write(data)
        self.hasher.update(data)

    def finish_blocking(self) -> str:
        os.fsync(self.file.fileno())
        self.file.close()
        return self.hasher.hexdigest()

    def discard_blocking(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.path.unlink(missing_ok=True)


def _read_and_hash(f, hasher, n: int) -> bytes:
    data = f.read(n)
    if data:
        hasher.update(data)
    return data


def check_upload_id(upload_id: str) -> str:
    if not isinstance(upload_id, str) or not _UPLOAD_ID.match(upload_id):
        raise InvalidArgument(f"upload_id {upload_id!r} is not an id from BeginGeneration")
    return upload_id


# ------------------------------------------------------------------------------------------------- store

class ArtifactStore:
    def __init__(self, index: RedisIndex, blobs: BlobBackend, metrics: StoreMetrics, *, limits: Limits = Limits(),
                 upload_ttl_s: float = 3600.0, spool_stale_s: float = 3600.0, gc_lock_s: float = 600.0,
                 failpoints: Iterable[str] = ()):
        self.index, self.blobs, self.metrics, self.limits = index, blobs, metrics, limits
        self.upload_ttl_ms = int(upload_ttl_s * 1000)
        self.spool_stale_s, self.gc_lock_ms = spool_stale_s, int(gc_lock_s * 1000)
        self.failpoints = frozenset(failpoints)

    async def _failpoint(self, name: str) -> None:
        """Testing only (settings.failpoints): stop here for good, so a test can SIGKILL the process at a
        known point of an upload or a commit."""
        if name in self.failpoints:
            print(f"FAILPOINT {name} reached", file=sys.stderr, flush=True)
            await asyncio.Event().wait()

    async def _blocking(self, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except BlobUnavailable as e:
            raise Unavailable(str(e)) from e

    # ------------------------------------------------------------------------------------------- writing
    async def begin(self, tenant: str, p: BeginParams) -> BeginResult:
        key = p.key.check()
        check_generation(p.generation)
        # up to 16k shards: checked in a thread, so the event loop (health checks, other RPCs) keeps running
        shards = await asyncio.to_thread(check_shard_table, key, p.shards, self.limits)
        generation, upload_id, expires, deleting = await self.index.begin(
            tenant, key, p.generation, shards, self.upload_ttl_ms)
        # Shards whose blob this document already holds need no upload. The blob is re-hashed first (a rotted
        # one must be uploaded again, which replaces it), and the upload's pins, set above, keep GC off it.
        by_digest: dict[str, list[ShardSpec]] = {}
        for s in shards:
            if s.digest not in deleting:
                by_digest.setdefault(s.digest, []).append(s)
        intact = await self._all_intact(tenant, key.doc_id, [specs[0] for specs in by_digest.values()])
        have = [s for specs, ok in zip(by_digest.values(), intact) if ok for s in specs]
        await self.index.mark_received(tenant, upload_id, have)
        stored = [s.ref for s in have]
        self.metrics.shards_deduplicated.inc(len(stored))
        return BeginResult(generation, upload_id, tuple(sorted(stored)), expires)

    async def put(self, tenant: str, chunks: AsyncIterator[PutChunk]) -> PutResult:
        """Store the shards a stream carries. Each shard is published only after its last chunk, once its size
        and digest match the declaration; an error discards the shard in progress (shards completed earlier in
        the same stream stay stored and recorded)."""
        upload: Upload | None = None
        declared: dict[tuple[int, str], ShardSpec] = {}
        spool: _Spool | None = None
        stored, total = [], 0
        try:
            async for c in chunks:
                if upload is None:
                    upload = await self.index.upload(tenant, check_upload_id(c.upload_id))
                    declared = {s.ref: s for s in upload.shards}
                elif c.upload_id and c.upload_id != upload.upload_id:
                    raise InvalidArgument("one PutShards stream carries one upload")
                if len(c.data) > CHUNK_BYTES:
                    raise InvalidArgument(f"chunk of {len(c.data)} bytes exceeds {CHUNK_BYTES}")
                if spool is None or (c.rank, c.name) != spool.spec.ref:
                    if spool is not None:
                        raise InvalidArgument(f"shard {spool.spec.name!r} (rank {spool.spec.rank}) ended after "
                                              f"{spool.received} of {spool.spec.size} bytes without last=true")
                    spec = declared.get((c.rank, c.name))
                    if spec is None:
                        raise InvalidArgument(f"shard {c.name!r} of rank {c.rank} is not declared in this upload")
                    if c.offset != 0:
                        raise InvalidArgument(f"shard {c.name!r}: first chunk at offset {c.offset}, expected 0")
                    if await self.index.is_deleting(tenant, upload.doc_id, spec.digest):
                        raise Unavailable(f"blob {spec.digest[:16]} is being garbage-collected; retry the shard")
                    spool = await self._blocking(_Spool, spec, self.blobs.spool_dir())
                spec = spool.spec
                if c.offset != spool.received:
                    raise InvalidArgument(f"shard {spec.name!r}: chunk at offset {c.offset}, expected "
                                          f"{spool.received} (chunks must come in order)")
                if spool.received + len(c.data) > spec.size:
                    raise InvalidArgument(f"shard {spec.name!r}: more than the declared {spec.size} bytes")
                await self._blocking(spool.write_blocking, c.data)
                spool.received += len(c.data)
                total += len(c.data)
                if c.last:
                    if spool.received != spec.size:
                        raise InvalidArgument(f"shard {spec.name!r}: last chunk after {spool.received} of "
                                              f"{spec.size} declared bytes")
                    digest = await self._blocking(spool.finish_blocking)
                    if digest != spec.digest:
                        self.metrics.digest_failures.labels("write").inc()
                        raise DataLoss(f"shard {spec.name!r}: received bytes hash to {digest[:16]}, "
                                       f"declared {spec.digest[:16]}; nothing stored")
                    await self._blocking(self.blobs.put_file_blocking,
                                         BlobKey(tenant, upload.doc_id, spec.digest), spool.path)
                    spool = None
                    await self.index.mark_received(tenant, upload.upload_id, [spec])
                    stored.append(spec.ref)
                    self.metrics.shards_stored.inc()
                    self.metrics.bytes_in.inc(spec.size)
                    await self._failpoint("put.after_shard")        # one shard stored, the stream still open
            if spool is not None:
                raise InvalidArgument(f"stream ended inside shard {spool.spec.name!r} ({spool.received} of "
                                      f"{spool.spec.size} bytes, no last=true)")
            if upload is None:
                raise InvalidArgument("empty PutShards stream")
            return PutResult(tuple(stored), total)
        finally:
            if spool is not None:
                await asyncio.to_thread(spool.discard_blocking)

    async def commit(self, tenant: str, upload_id: str) -> CommitResult:
        try:
            upload = await self.index.upload(tenant, check_upload_id(upload_id))
            missing = [s for s in upload.shards if s.ref not in upload.received]
            if missing:
                raise FailedPrecondition(f"{len(missing)} of {len(upload.shards)} declared shards are not stored, "
                                         f"e.g. {missing[0].name!r} of rank {missing[0].rank}")
            digests = {s.digest: s for s in upload.shards}
            sizes = await self._sizes(tenant, upload.doc_id, list(digests.values()))
            for (d, spec), got in zip(digests.items(), sizes):
                want = spec.size
                if got != want:
                    raise FailedPrecondition(f"blob {d[:16]} is {'missing' if got is None else f'{got} bytes'} "
                                             f"(declared {want}); put its shard again")
            manifest = Manifest(upload.key, upload.generation, upload.shards)
            await self._failpoint("commit.before_script")
            became, current, at = await self.index.commit(tenant, upload, manifest)
            await self._failpoint("commit.after_script")
        except StoreError as e:
            self.metrics.commits.labels({"AlreadyExists": "already_exists", "FailedPrecondition": "incomplete",
                                         "NotFound": "not_found"}.get(type(e).__name__, "error")).inc()
            raise
        self.metrics.commits.labels("ok").inc()
        log.info("committed %s generation %d (%d shards, current %d)", upload.doc_id, upload.generation,
                 len(upload.shards), current)
        return CommitResult(Manifest(upload.key, upload.generation, upload.shards, at), became, current)

    async def _all_intact(self, tenant: str, doc_id: str, specs: list[ShardSpec]) -> list[bool]:
        """Is the stored blob of each spec present with the right size and digest? (A corrupt one counts as a read
        digest failure.) The sizes come from a few thread calls, and at most INTACT_WORKERS blobs are hashed at once:
        16k declared shards must not flood the event loop with 16k tasks (a health check would wait behind them)."""
        sizes = await self._sizes(tenant, doc_id, specs)
        todo = iter([i for i, (s, n) in enumerate(zip(specs, sizes)) if n == s.size])
        out = [False] * len(specs)

        async def worker():
            for i in todo:
                try:
                    async for _ in self._read_verified(tenant, doc_id, specs[i], 0, count=False):
                        pass
                    out[i] = True
                except DataLoss:
                    pass

        await asyncio.gather(*(worker() for _ in range(INTACT_WORKERS)))
        return out

    async def _sizes(self, tenant: str, doc_id: str, specs: list[ShardSpec]) -> list[int | None]:
        """The blob sizes of `specs`, by INTACT_WORKERS thread calls over slices: a few tasks on the event loop
        whatever the count, and still parallel where a size is a round trip (an S3 HEAD)."""
        n = max(1, -(-len(specs) // INTACT_WORKERS))
        parts = await asyncio.gather(*(self._blocking(self._sizes_blocking, tenant, doc_id, specs[i:i + n])
                                       for i in range(0, len(specs), n)))
        return [size for part in parts for size in part]

    def _sizes_blocking(self, tenant: str, doc_id: str, specs: list[ShardSpec]) -> list[int | None]:
        return [self.blobs.size_blocking(BlobKey(tenant, doc_id, s.digest)) for s in specs]

    # ------------------------------------------------------------------------------------------- reading
    async def manifest(self, tenant: str, key: DocumentKey, generation: int) -> ManifestResult:
        key.check()
        check_generation(generation)
        m, cur, gens = await self.index.manifest(tenant, key, generation)
        return ManifestResult(m, cur, gens)

    async def select(self, tenant: str, p: FetchParams) -> tuple[int, list[ShardSpec]]:
        """The generation and the shards a fetch selects: the one place a fetch is checked, authorized (by the
        caller's tenant) and resolved, for the gRPC stream and the local socket alike."""
        key = p.key.check()
        if not isinstance(p.rank, int) or not 0 <= p.rank < key.tp_size:
            raise InvalidArgument(f"rank {p.rank!r} outside tp_size {key.tp_size}")
        check_generation(p.generation)
        for what, r in (("layers", p.layers), ("channels", p.channels)):
            if r is not None:
                r.check(what)
        m, _, _ = await self.index.manifest(tenant, key, p.generation)     # resolved once: one generation
        shards = m.select(p.rank, p.layers, p.channels, p.names)
        absent = sorted(set(p.names) - {s.name for s in shards})
        if absent:
            raise NotFound(f"generation {m.generation} rank {p.rank} has no selected shard named {absent}")
        return m.generation, shards

    async def fetch(self, tenant: str, p: FetchParams) -> AsyncIterator[FetchChunk]:
        generation, shards = await self.select(tenant, p)
        doc_id = p.key.doc_id
        # Read ahead: a task reads and hashes the next chunks (at most READ_AHEAD of them, so memory stays
        # bounded per stream) while the transport sends the current one.
        queue: asyncio.Queue = asyncio.Queue(maxsize=READ_AHEAD)

        async def produce():
            try:
                for s in shards:
                    async for chunk in self._read_verified(tenant, doc_id, s, generation):
                        await queue.put(chunk)
                await queue.put(None)
            except Exception as e:          # noqa: BLE001 - handed to the consumer, which raises it
                await queue.put(e)

        task = asyncio.create_task(produce())
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _read_verified(self, tenant: str, doc_id: str, s: ShardSpec, generation: int, count: bool = True
                             ) -> AsyncIterator[FetchChunk]:
        """Chunks of one shard; each is sent only once the next has been read, and the last only after the
        whole shard's size and digest match, so a reader never gets a complete corrupt shard."""
        try:
            f = await self._blocking(self.blobs.open_blocking, BlobKey(tenant, doc_id, s.digest))
        except BlobMissing:
            self.metrics.digest_failures.labels("read").inc()
            raise DataLoss(f"shard {s.name!r} (rank {s.rank}): its blob {s.digest[:16]} is missing") from None
        try:
            hasher, offset, pending = new_hasher(), 0, None
            while True:
                data = await self._blocking(_read_and_hash, f, hasher, CHUNK_BYTES)
                if not data:
                    break
                if pending is not None:
                    yield pending
                pending = FetchChunk(s if offset == 0 else None, generation, offset, data, False)
                offset += len(data)
                if offset > s.size:
                    break
            digest = hasher.hexdigest() if offset <= s.size else "(longer than declared)"
            if offset != s.size or digest != s.digest:
                self.metrics.digest_failures.labels("read").inc()
                raise DataLoss(f"shard {s.name!r} (rank {s.rank}) is corrupt: {offset} bytes hashing to "
                               f"{digest[:16]}, committed {s.size} bytes {s.digest[:16]}")
            if pending is None:
                pending = FetchChunk(s, generation, 0, b"", False)
            yield FetchChunk(pending.shard, generation, pending.offset, pending.data, True)
            if count:
                self.metrics.shards_served.labels("grpc").inc()
                self.metrics.bytes_out.labels("grpc").inc(s.size)
        finally:
            await asyncio.to_thread(f.close)

    # ------------------------------------------------------------------------------- co-located readers
    async def open_blob(self, tenant: str, doc_id: str, s: ShardSpec) -> BinaryIO:
        """For the local socket (local_server.py), which hands the descriptor to a co-located reader: the blob of
        a shard `select` returned, opened read-only with its size checked, so a missing or truncated blob is
        DataLoss here and counted. The digest is checked by the reader over the bytes it actually reads
        (local_client.py), which reports a mismatch to `confirm_corrupt`. The caller closes the file."""
        return await self._blocking(self._open_sized, BlobKey(tenant, doc_id, s.digest), s)

    def _open_sized(self, key: BlobKey, s: ShardSpec) -> BinaryIO:
        try:
            f = self.blobs.open_blocking(key)
        except BlobMissing:
            self.metrics.digest_failures.labels("read").inc()
            raise DataLoss(f"shard {s.name!r} (rank {s.rank}): its blob {s.digest[:16]} is missing") from None
        size = os.fstat(f.fileno()).st_size
        if size != s.size:
            f.close()
            self.metrics.digest_failures.labels("read").inc()
            raise DataLoss(f"shard {s.name!r} (rank {s.rank}) is corrupt: its blob holds {size} bytes, committed "
                           f"{s.size}")
        return f

    async def confirm_corrupt(self, tenant: str, p: FetchParams) -> bool:
        """A local reader found the one shard `p` names not matching its digest. It is read and hashed again
        here, and only a blob that really is corrupt counts (in `digest_failures{stage="read"}`, moved by
        _read_verified), so a false report cannot move the counter."""
        if len(p.names) != 1 or not p.generation:
            raise InvalidArgument("a corruption report names one shard of one generation")
        generation, shards = await self.select(tenant, p)
        try:
            async for _ in self._read_verified(tenant, p.key.doc_id, shards[0], generation, count=False):
                pass
        except DataLoss:
            return True
        return False

    async def validate(self, tenant: str, p: ValidateParams) -> Verdict:
        """The store's half of SPEC §6: does the stored generation match what this rank expects? Checks run in
        the runtime's order (checkpoint, tokens, profile, geometry, layers, generation, digests)."""
        key = p.key.check()
        if not isinstance(p.rank, int) or not 0 <= p.rank <= MAX_INT64:
            raise InvalidArgument(f"tp_rank {p.rank!r} is not in 0..2^63-1")
        if p.channels is not None:
            p.channels.check("channels")
        if any(not isinstance(x, int) or not 0 <= x <= MAX_INT64 for x in p.layers_needed):
            raise InvalidArgument("layers_needed holds a layer outside 0..2^63-1")
        check_generation(p.generation)
        if p.certificate_digest:
            check_digest("certificate_digest", p.certificate_digest)
        R = Reason
        try:
            m, cur, _ = await self.index.manifest(tenant, key, 0)
        except NotFound:
            return await self._why_absent(tenant, key)
        except DataLoss as e:                   # the index's manifest itself is corrupt
            self.metrics.digest_failures.labels("read").inc()
            return Verdict(False, R.DIGEST_MISMATCH, str(e))
        if p.rank >= key.tp_size:
            return Verdict(False, R.TP_GEOMETRY_MISMATCH, f"rank {p.rank} outside tp_size {key.tp_size}", cur)
        mine = m.select(p.rank)
        cert = next((s for s in mine if s.kind is ShardKind.CERTIFICATE), None)
        if cert is None:                        # a committed table always has one: the index entry was altered
            self.metrics.digest_failures.labels("read").inc()
            return Verdict(False, R.DIGEST_MISMATCH, f"the index's manifest has no certificate for rank {p.rank}", cur)
        if p.channels is not None:
            other = sorted({(s.channels.lo, s.channels.hi) for s in mine if s.kind is ShardKind.LOCAL}
                           - {(p.channels.lo, p.channels.hi)})
            if other:
                return Verdict(False, R.TP_GEOMETRY_MISMATCH, f"rank {p.rank} stores channels {other}, expected "
                               f"[{p.channels.lo}, {p.channels.hi})", cur, cert.digest)
        # ranges, never sets of layers: a layer group [0, 2^62) costs what [0, 1) costs
        absent = uncovered(p.layers_needed, covered(s.layers for s in mine))
        if absent:
            more = f" and {len(absent) - 32} more" if len(absent) > 32 else ""
            return Verdict(False, R.MISSING_LAYER, f"layers {absent[:32]}{more} have no shard for rank {p.rank}", cur,
                           cert.digest)
        if p.generation and p.generation != cur:
            return Verdict(False, R.STALE_GENERATION, f"certificate generation {p.generation}, current is {cur}",
                           cur, cert.digest)
        if p.certificate_digest and p.certificate_digest != cert.digest:
            return Verdict(False, R.DIGEST_MISMATCH, f"certificate digest {p.certificate_digest[:16]} != stored "
                           f"{cert.digest[:16]}", cur, cert.digest)
        if p.deep:
            for s in mine:
                try:
                    async for _ in self._read_verified(tenant, key.doc_id, s, m.generation, count=False):
                        pass
                except DataLoss as e:
                    return Verdict(False, R.DIGEST_MISMATCH, str(e), cur, cert.digest)
        else:           # sizes in a few thread calls: a rank may hold 16k shards
            sizes = await self._sizes(tenant, key.doc_id, mine)
            for s, size in zip(mine, sizes):
                if size is None:
                    return Verdict(False, R.MISSING_SHARD, f"shard {s.name!r} has no blob", cur, cert.digest)
                if size != s.size:
                    self.metrics.digest_failures.labels("read").inc()
                    return Verdict(False, R.DIGEST_MISMATCH, f"shard {s.name!r} holds {size} bytes, committed "
                                   f"{s.size}", cur, cert.digest)
        return Verdict(True, None, "", cur, cert.digest)

    async def _why_absent(self, tenant: str, key: DocumentKey) -> Verdict:
        """No readable generation under this exact key: say which part of the key differs, if any document of
        the caller has the same doc_hash."""
        R = Reason
        _, ids = await self.index.list_doc_ids(tenant, 0, 1000, key.doc_hash)
        states = [s for s in [await self.index.doc_state(tenant, d) for d in ids] if s is not None]
        if not states:
            return Verdict(False, R.MISSING_SHARD, "no readable artifact for this document")
        if not any(s.key.checkpoint_fingerprint == key.checkpoint_fingerprint for s in states):
            return Verdict(False, R.CHECKPOINT_MISMATCH, "artifacts of this document exist for other checkpoints")
        if not any(s.key.profile == key.profile for s in states):
            return Verdict(False, R.PROFILE_MISMATCH, "artifacts of this document exist for other profiles")
        return Verdict(False, R.TP_GEOMETRY_MISMATCH, "artifacts of this document exist for other TP sizes")

    async def list_documents(self, tenant: str, page_size: int, page_token: str, doc_hash: str
                             ) -> tuple[list[DocumentSummary], str]:
        if not isinstance(page_size, int) or not 0 <= page_size <= 1000:
            raise InvalidArgument(f"page_size {page_size!r} is not in 0..1000")
        if page_token and not (_PAGE_TOKEN.fullmatch(page_token) and int(page_token) < 1 << 64):
            raise InvalidArgument(f"page_token {page_token[:64]!r} is not a token from ListDocuments")
        if doc_hash:
            check_digest("doc_hash", doc_hash)
        cursor, ids = await self.index.list_doc_ids(tenant, int(page_token or 0), page_size or 100, doc_hash)
        out = []
        for d in ids:
            st = await self.index.doc_state(tenant, d)
            if st is not None:
                out.append(DocumentSummary(st.key, st.current, st.generations))
        return out, (str(cursor) if cursor else "")

    async def retire(self, tenant: str, key: DocumentKey, generation: int) -> int:
        key.check()
        check_generation(generation, allow_zero=False)
        return await self.index.retire(tenant, key, generation)

    # ------------------------------------------------------------------------------------------------ GC
    async def collect_garbage(self, tenant: str, key: DocumentKey | None) -> GcResult:
        """Delete the blobs of the caller's documents that no readable generation and no open upload references.
        A blob is first claimed in the index (atomically, only if unreferenced and unpinned), then deleted, then
        released; puts and commits of a claimed digest wait, so nothing that becomes referenced is deleted."""
        doc_ids = [key.check().doc_id] if key is not None else await self.index.all_doc_ids(tenant)
        deleted = freed = kept = 0
        for doc_id in doc_ids:
            token = await self.index.gc_lock(tenant, doc_id, self.gc_lock_ms)
            if token is None:
                continue                    # another replica is collecting this document
            try:
                leftovers = await self.index.gc_leftovers(tenant, doc_id)
                for d in leftovers:
                    freed += await self._blocking(self.blobs.delete_blocking, BlobKey(tenant, doc_id, d))
                await self.index.gc_unmark(tenant, doc_id, leftovers)
                blobs = await self._blocking(self.blobs.list_blocking, tenant, doc_id)
                refs = await self.index.referenced(tenant, doc_id)
                marked = await self.index.gc_mark(tenant, doc_id, [d for d, _ in blobs if d not in refs])
                for d in marked:
                    freed += await self._blocking(self.blobs.delete_blocking, BlobKey(tenant, doc_id, d))
                await self.index.gc_unmark(tenant, doc_id, marked)
                deleted += len(marked) + len(leftovers)
                kept += len(blobs) - len(marked)
            finally:
                await self.index.gc_unlock(tenant, doc_id, token)
        self.metrics.gc_blobs_deleted.inc(deleted)
        removed = await self._blocking(self.blobs.remove_stale_spool_blocking, self.spool_stale_s)
        return GcResult(deleted, freed, kept, removed)
