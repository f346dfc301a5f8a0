"""What the store names and checks: document keys, shard specs, ranges, digests, manifests (SPEC §8).

A document is (tenant, doc_hash, checkpoint fingerprint, profile, TP size); a shard of one generation is
(rank, name) with its layer group, channel range, digest and size. Everything a request says is checked
here before anything is written, so a malformed request fails with InvalidArgument and changes nothing.
Digests are blake3 hex over the exact bytes, the same function as `runtime.reuse.certificate.digest_bytes`
(this module does not import it: the store must not need torch or the model)."""
from __future__ import annotations

import bisect
import enum
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import blake3
import msgpack

from .errors import DataLoss, InvalidArgument, LimitExceeded

HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
CHUNK_BYTES = 4 << 20                        # largest data field of one PutShards / FetchShards message
MAX_MESSAGE_BYTES = CHUNK_BYTES + (64 << 10)  # one chunk plus its header fields: the gRPC message limit
# The index's Lua scripts hold generations as Lua numbers (doubles): every integer up to 2^53 is exact there, and
# allocation adds one to the highest, so a generation is at most 2^53 - 1 (the proto field is a uint64).
MAX_GENERATION = (1 << 53) - 1
MAX_INT64 = (1 << 63) - 1                     # range bounds, sizes, offsets: int64 on the wire and in msgpack


def digest_bytes(b: bytes | bytearray | memoryview) -> str:
    return blake3.blake3(b).hexdigest()


def new_hasher() -> blake3.blake3:
    # AUTO threads: blake3 splits large updates across cores and releases the GIL while hashing
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def check_name(what: str, value: object, pattern: re.Pattern = _NAME) -> str:
    """A name that is safe as one path component and one Redis key part: no '/', no '..', no leading dot."""
    if not isinstance(value, str) or not pattern.match(value) or ".." in value:
        raise InvalidArgument(f"{what} {value!r} must match {pattern.pattern} and contain no '..'")
    return value


def check_tenant(tenant: str) -> str:
    return check_name("tenant", tenant, _TENANT)


def check_digest(what: str, value: object) -> str:
    if not isinstance(value, str) or not HEX64.match(value):
        raise InvalidArgument(f"{what} {value!r} is not a blake3 hex digest (64 lowercase hex digits)")
    return value


def profile_id(profile: dict) -> str:
    """Key part for a runtime profile dict (ReuseProfile.to_dict()): its name plus a digest of every setting,
    so two profiles that share a name but differ in any setting never share artifacts."""
    canon = json.dumps(profile, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    name = re.sub(r"[^A-Za-z0-9_-]", "_", str(profile.get("name", "profile")))[:64] or "profile"
    return f"{name}-{digest_bytes(canon)[:16]}"


class Reason(str, enum.Enum):
    """Same values as runtime.reuse.certificate.FallbackReason (a test keeps them equal); the store does not
    import the runtime, which needs torch."""
    MISSING_LAYER = "missing_layer"
    MISSING_SHARD = "missing_shard"
    TOKEN_MISMATCH = "token_mismatch"
    PROFILE_MISMATCH = "profile_mismatch"
    STALE_GENERATION = "stale_generation"
    TP_GEOMETRY_MISMATCH = "tp_geometry_mismatch"
    DIGEST_MISMATCH = "digest_mismatch"
    RANK_DISAGREEMENT = "rank_disagreement"
    STORE_UNAVAILABLE = "store_unavailable"
    CHECKPOINT_MISMATCH = "checkpoint_mismatch"
    PRODUCER_MISMATCH = "producer_mismatch"
    UNCALIBRATED = "uncalibrated"


class ShardKind(str, enum.Enum):
    LATENT = "latent"
    LOCAL = "local"
    MANIFEST = "manifest"
    CERTIFICATE = "certificate"
    OTHER = "other"


@dataclass(frozen=True)
class Range:
    """Half-open [lo, hi)."""
    lo: int = 0
    hi: int = 0

    @property
    def empty(self) -> bool:
        return self.hi <= self.lo

    def check(self, what: str) -> "Range":
        if not (isinstance(self.lo, int) and isinstance(self.hi, int) and 0 <= self.lo <= self.hi <= MAX_INT64):
            raise InvalidArgument(f"{what} [{self.lo}, {self.hi}) is not a range with 0 <= lo <= hi < 2^63")
        return self

    def intersects(self, other: "Range") -> bool:
        return max(self.lo, other.lo) < min(self.hi, other.hi)

    def within(self, other: "Range") -> bool:
        return other.lo <= self.lo and self.hi <= other.hi


def check_generation(value: object, *, allow_zero: bool = True) -> int:
    """A generation a request names: 0 (allocate, or: the current one) where allowed, else 1..MAX_GENERATION."""
    if not isinstance(value, int) or isinstance(value, bool) or not (0 if allow_zero else 1) <= value <= MAX_GENERATION:
        raise InvalidArgument(f"generation {value!r} is not in {0 if allow_zero else 1}..{MAX_GENERATION} (2^53 - 1)")
    return value


def covered(ranges: Iterable[Range]) -> list[Range]:
    """The union of `ranges` as disjoint, sorted, non-adjacent ranges: O(n log n) in the number of ranges,
    whatever their lengths (a layer group [0, 2^62) is one range, never a set of 2^62 layers)."""
    out: list[Range] = []
    for r in sorted((r for r in ranges if not r.empty), key=lambda r: r.lo):
        if out and r.lo <= out[-1].hi:
            if r.hi > out[-1].hi:
                out[-1] = Range(out[-1].lo, r.hi)
        else:
            out.append(r)
    return out


def uncovered(points: Iterable[int], union: list[Range]) -> list[int]:
    """The sorted distinct points outside `union` (the output of `covered`): O(k log n)."""
    los = [r.lo for r in union]
    out = []
    for x in sorted(set(points)):
        i = bisect.bisect_right(los, x) - 1
        if i < 0 or x >= union[i].hi:
            out.append(x)
    return out


def content_hash(padded_token_hash: str, n_content: int) -> str:
    """A DocumentKey's `doc_hash`: the token hash of a document's PADDED ids (what its certificate binds) together
    with its content length, so the key is a function of exactly the unpadded ids. (The padded hash alone gave
    T and T+[pad] one key, so deleting one broke the other.)"""
    if not isinstance(n_content, int) or n_content < 0:
        raise InvalidArgument(f"n_content {n_content!r} is not a non-negative int")
    h = blake3.blake3(b"redknot.store.content.v1\0")
    h.update(len(padded_token_hash).to_bytes(4, "little") + padded_token_hash.encode())
    h.update(n_content.to_bytes(8, "little"))
    return h.hexdigest()


@dataclass(frozen=True)
class DocumentKey:
    doc_hash: str
    checkpoint_fingerprint: str
    profile: str
    tp_size: int

    def check(self) -> "DocumentKey":
        check_digest("doc_hash", self.doc_hash)
        check_digest("checkpoint_fingerprint", self.checkpoint_fingerprint)
        check_name("profile", self.profile)
        if not isinstance(self.tp_size, int) or not 1 <= self.tp_size <= 4096:
            raise InvalidArgument(f"tp_size {self.tp_size!r} is not in 1..4096")
        return self

    @property
    def doc_id(self) -> str:
        """Stable id of the key (not secret; tenant-scoped by every Redis key and blob path that uses it)."""
        h = blake3.blake3(b"redknot.store.doc.v1\0")
        for part in (self.doc_hash, self.checkpoint_fingerprint, self.profile, str(self.tp_size)):
            h.update(len(part).to_bytes(4, "little") + part.encode())
        return h.hexdigest()[:32]

    def to_dict(self) -> dict:
        return {"doc_hash": self.doc_hash, "checkpoint_fingerprint": self.checkpoint_fingerprint,
                "profile": self.profile, "tp_size": self.tp_size}

    @staticmethod
    def from_dict(d: dict) -> "DocumentKey":
        return DocumentKey(d["doc_hash"], d["checkpoint_fingerprint"], d["profile"], int(d["tp_size"]))


@dataclass(frozen=True)
class ShardSpec:
    name: str
    rank: int
    kind: ShardKind
    digest: str
    size: int
    layers: Range = field(default_factory=Range)
    channels: Range = field(default_factory=Range)

    @property
    def ref(self) -> tuple[int, str]:
        return (self.rank, self.name)

    def to_list(self) -> list:
        return [self.name, self.rank, self.kind.value, self.digest, self.size, [self.layers.lo, self.layers.hi],
                [self.channels.lo, self.channels.hi]]

    @staticmethod
    def from_list(v: list) -> "ShardSpec":
        """From the index; anything but a well-formed spec raises (Manifest.from_bytes turns it into DataLoss)."""
        name, rank, kind, digest, size, (llo, lhi), (clo, chi) = v
        s = ShardSpec(check_name("shard name", name), rank, ShardKind(kind), check_digest("digest", digest), size,
                      Range(llo, lhi).check("layers"), Range(clo, chi).check("channels"))
        if not (isinstance(rank, int) and 0 <= rank and isinstance(size, int) and 0 <= size <= MAX_INT64):
            raise ValueError(f"shard {name!r}: rank {rank!r} or size {size!r}")
        return s


@dataclass(frozen=True)
class FetchedShard:
    """One shard as a client returns it (over gRPC or the local socket): its spec, generation and bytes (None from
    `LocalStoreClient.fetch_into`, which put them in the caller's buffers)."""
    spec: ShardSpec
    generation: int
    data: bytes | None


@dataclass(frozen=True)
class Limits:
    max_shard_bytes: int = 1 << 30
    max_shards_per_generation: int = 16384


def check_shard_table(key: DocumentKey, shards: Iterable[ShardSpec], limits: Limits) -> list[ShardSpec]:
    """The declared shards of one generation, sorted by (rank, name). Rules: at least one shard; (rank, name)
    unique; ranks inside the TP size; every rank has exactly one certificate; LOCAL shards carry a non-empty
    channel range and no two LOCAL shards of one rank overlap in both layers and channels; other kinds carry
    no channel range."""
    shards = list(shards)
    if not shards:
        raise InvalidArgument("a generation needs at least one shard")
    if len(shards) > limits.max_shards_per_generation:
        raise LimitExceeded(f"{len(shards)} shards exceed the limit of {limits.max_shards_per_generation} per "
                            f"generation")
    seen: set[tuple[int, str]] = set()
    certs: dict[int, int] = {}
    local: dict[int, list[ShardSpec]] = {}
    for s in shards:
        check_name("shard name", s.name)
        if not isinstance(s.rank, int) or not 0 <= s.rank < key.tp_size:
            raise InvalidArgument(f"shard {s.name!r}: rank {s.rank!r} outside tp_size {key.tp_size}")
        if not isinstance(s.kind, ShardKind):
            raise InvalidArgument(f"shard {s.name!r}: kind is not set")
        check_digest(f"shard {s.name!r} digest", s.digest)
        if not isinstance(s.size, int) or s.size < 0:
            raise InvalidArgument(f"shard {s.name!r}: size {s.size!r} is negative")
        if s.size > limits.max_shard_bytes:
            raise LimitExceeded(f"shard {s.name!r}: {s.size} bytes exceed the limit of {limits.max_shard_bytes}")
        s.layers.check(f"shard {s.name!r} layers")
        s.channels.check(f"shard {s.name!r} channels")
        if s.ref in seen:
            raise InvalidArgument(f"shard {s.name!r} of rank {s.rank} is declared twice")
        seen.add(s.ref)
        if s.kind is ShardKind.LOCAL:
            if s.channels.empty:
                raise InvalidArgument(f"LOCAL shard {s.name!r} needs a non-empty channel range")
            local.setdefault(s.rank, []).append(s)
        elif not s.channels.empty or s.channels.lo:
            raise InvalidArgument(f"{s.kind.value} shard {s.name!r} cannot carry a channel range")
        if s.kind is ShardKind.CERTIFICATE:
            certs[s.rank] = certs.get(s.rank, 0) + 1
    for rank in range(key.tp_size):
        if certs.get(rank, 0) != 1:
            raise InvalidArgument(f"rank {rank} has {certs.get(rank, 0)} certificate shards; every rank needs "
                                  f"exactly one")
    for rank, ls in local.items():
        clash = local_overlap(ls)
        if clash is not None:
            a, b = clash
            raise InvalidArgument(f"rank {rank}: LOCAL shards {a.name!r} and {b.name!r} overlap in channels "
                                  f"[{a.channels.lo}, {a.channels.hi}) and [{b.channels.lo}, {b.channels.hi})")
    return sorted(shards, key=lambda s: s.ref)


def _clash(a: ShardSpec, b: ShardSpec) -> bool:
    """The rule itself: two LOCAL shards of one rank overlapping in channels, in the same layers (or both
    layer-less), would make a selection ambiguous."""
    return a.channels.intersects(b.channels) and (a.layers.intersects(b.layers) or (a.layers.empty and b.layers.empty))


def local_overlap_reference(ls: list[ShardSpec]) -> tuple[ShardSpec, ShardSpec] | None:
    """Every pair, O(n^2): the reference `local_overlap` is tested against."""
    for i, a in enumerate(ls):
        for b in ls[i + 1:]:
            if _clash(a, b):
                return a, b
    return None


def local_overlap(ls: list[ShardSpec]) -> tuple[ShardSpec, ShardSpec] | None:
    """A pair of LOCAL shards of one rank that `_clash`, or None; O(n log n).

    Layer-less shards clash by channels alone: sorted by channel start, the first one that starts before the
    previous ends clashes with it (until a clash, those seen are disjoint, so the previous has the largest end).
    Shards with layers are rectangles layers x channels: a sweep over layers keeps the shards whose layer group
    contains the sweep position, sorted by channel start. Until a clash these are disjoint in channels, so a shard
    entering clashes with one of them iff it clashes with its neighbour on either side. A shard leaves at its
    layer end before any shard enters there (half-open ranges)."""
    flat = sorted((s for s in ls if s.layers.empty), key=lambda s: (s.channels.lo, s.name))
    for a, b in zip(flat, flat[1:]):
        if b.channels.lo < a.channels.hi:
            return a, b
    events = []                              # (layer, 0: leaves | 1: enters, shard)
    for s in ls:
        if not s.layers.empty:
            events += [(s.layers.lo, 1, s), (s.layers.hi, 0, s)]
    events.sort(key=lambda e: (e[0], e[1], e[2].channels.lo, e[2].name))
    # bisect finds a place in O(log n); the list insert/delete then moves pointers (memmove: ~1 ms per 16k)
    los: list[int] = []                      # channel starts of the active shards, sorted (distinct: disjoint)
    active: list[ShardSpec] = []             # the active shards in the same order
    for _, enters, s in events:
        j = bisect.bisect_left(los, s.channels.lo)
        if not enters:
            assert active[j] is s, (s.name, active[j].name)
            del los[j], active[j]
            continue
        if j < len(active) and active[j].channels.lo < s.channels.hi:
            return active[j], s
        if j > 0 and active[j - 1].channels.hi > s.channels.lo:
            return active[j - 1], s
        los.insert(j, s.channels.lo)
        active.insert(j, s)
    return None


@dataclass(frozen=True)
class Manifest:
    key: DocumentKey
    generation: int
    shards: tuple[ShardSpec, ...]
    committed_at_unix_ms: int = 0

    def shard_table_bytes(self) -> bytes:
        """What the index stores for a generation (the commit time is stored beside it)."""
        return msgpack.packb({"format": 1, "key": self.key.to_dict(), "generation": self.generation,
                              "shards": [s.to_list() for s in self.shards]}, use_bin_type=True)

    @staticmethod
    def from_bytes(raw: bytes, committed_at_unix_ms: int = 0, where: str = "manifest") -> "Manifest":
        """A manifest as the index stores it. A stored manifest that is not one (a corrupt or altered index entry)
        is DataLoss, like corrupt blob bytes: a reader falls back with reason digest_mismatch, never
        store_unavailable (the store is reachable; what it holds is wrong)."""
        try:
            d = msgpack.unpackb(raw, raw=False)
            if d["format"] != 1:
                raise ValueError(f"format {d['format']!r}")
            m = Manifest(DocumentKey.from_dict(d["key"]).check(), check_generation(d["generation"], allow_zero=False),
                         tuple(ShardSpec.from_list(s) for s in d["shards"]), committed_at_unix_ms)
        except Exception as e:      # noqa: BLE001 - whatever a corrupt entry makes msgpack or the checks raise
            raise DataLoss(f"the index's {where} is corrupt ({type(e).__name__}: {e})"[:500]) from None
        return m

    def select(self, rank: int, layers: Range | None = None, channels: Range | None = None,
               names: Iterable[str] = ()) -> list[ShardSpec]:
        """Shards of `rank`; with `layers`, only those whose layer group intersects it (rank-level shards have no
        layer group and drop out); with `channels`, LOCAL shards must lie inside it; with `names`, only those."""
        names = set(names)
        out = []
        for s in self.shards:
            if s.rank != rank or (names and s.name not in names):
                continue
            if layers is not None and not s.layers.intersects(layers):
                continue
            if channels is not None and s.kind is ShardKind.LOCAL and not s.channels.within(channels):
                continue
            out.append(s)
        return out
