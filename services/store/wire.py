"""Conversions between the wire contract (services/store/pb, generated from proto/) and the store's types.
Used by the gRPC adapter and the client, so both sides read and write messages the same way."""
from __future__ import annotations

from .errors import InvalidArgument
from .keys import DocumentKey, Manifest, Range, Reason, ShardKind, ShardSpec
from .pb import artifact_store_pb2 as pb

KIND_TO_PB = {ShardKind.LATENT: pb.SHARD_KIND_LATENT, ShardKind.LOCAL: pb.SHARD_KIND_LOCAL,
              ShardKind.MANIFEST: pb.SHARD_KIND_MANIFEST, ShardKind.CERTIFICATE: pb.SHARD_KIND_CERTIFICATE,
              ShardKind.OTHER: pb.SHARD_KIND_OTHER}
KIND_FROM_PB = {v: k for k, v in KIND_TO_PB.items()}
REASON_TO_PB = {r: pb.FallbackReason.Value("FALLBACK_REASON_" + r.name) for r in Reason}
REASON_FROM_PB = {v: k for k, v in REASON_TO_PB.items()}


def key_from_pb(m: pb.DocumentKey) -> DocumentKey:
    return DocumentKey(m.doc_hash, m.checkpoint_fingerprint, m.profile, m.tp_size)


def key_to_pb(k: DocumentKey) -> pb.DocumentKey:
    return pb.DocumentKey(doc_hash=k.doc_hash, checkpoint_fingerprint=k.checkpoint_fingerprint, profile=k.profile,
                          tp_size=k.tp_size)


def range_from_pb(m: pb.Range) -> Range:
    return Range(m.lo, m.hi)


def optional_range(parent, field: str) -> Range | None:
    return range_from_pb(getattr(parent, field)) if parent.HasField(field) else None


def range_to_pb(r: Range) -> pb.Range:
    return pb.Range(lo=r.lo, hi=r.hi)


def shard_from_pb(m: pb.ShardSpec) -> ShardSpec:
    if m.kind not in KIND_FROM_PB:
        raise InvalidArgument(f"shard {m.name!r}: kind {m.kind} is not a known ShardKind")
    return ShardSpec(m.name, m.rank, KIND_FROM_PB[m.kind], m.digest, m.size, range_from_pb(m.layers),
                     range_from_pb(m.channels))


def shard_to_pb(s: ShardSpec) -> pb.ShardSpec:
    return pb.ShardSpec(name=s.name, rank=s.rank, kind=KIND_TO_PB[s.kind], layers=range_to_pb(s.layers),
                        channels=range_to_pb(s.channels), digest=s.digest, size=s.size)


def manifest_to_pb(m: Manifest) -> pb.Manifest:
    return pb.Manifest(key=key_to_pb(m.key), generation=m.generation, shards=[shard_to_pb(s) for s in m.shards],
                       committed_at_unix_ms=m.committed_at_unix_ms)


def manifest_from_pb(m: pb.Manifest) -> Manifest:
    return Manifest(key_from_pb(m.key), m.generation, tuple(shard_from_pb(s) for s in m.shards),
                    m.committed_at_unix_ms)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


_DATA_TAG = bytes([(pb.FetchShardsResponse.DESCRIPTOR.fields_by_name["data"].number << 3) | 2])


def fetch_response_bytes(shard: ShardSpec | None, generation: int, offset: int, data: bytes, last: bool) -> bytes:
    """A serialized FetchShardsResponse, built without copying `data` into a message first (one copy instead
    of three for a 4 MiB chunk). Protobuf parsers accept fields in any order, so this equals
    `FetchShardsResponse(...).SerializeToString()` as a message (a test checks it)."""
    head = pb.FetchShardsResponse(shard=shard_to_pb(shard) if shard else None, generation=generation,
                                  offset=offset, last=last).SerializeToString()
    return b"".join((head, _DATA_TAG, _varint(len(data)), data)) if data else head
