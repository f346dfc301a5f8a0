"""Typed, synchronous client of the artifact store, for producers and TP workers.

    client = StoreClient("127.0.0.1:50051", token)
    client.put_artifact([rank0_dir, rank1_dir])          # begin, upload what is missing, commit atomically
    client.fetch_rank(key, rank, "cache/doc/r1")         # a directory runtime.reuse.store.load_artifact reads
    for shard in client.fetch(key, rank, layers=Range(8, 12)):   # prefetch a layer group into memory
        ...

Every call raises a `services.store.errors.StoreError` subclass on failure; `fallback_reason(err)` names the
SPEC §6 fallback a worker records for it. Fetched bytes are verified here too, so a shard that arrives
truncated or altered is never returned."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from . import wire
from .calibration import CalibrationEntry, CalibrationKey, StoredCalibration
from .core import BeginResult, CommitResult, DocumentSummary, GcResult, ManifestResult, PutResult, Verdict
from .errors import DataLoss, NoLocalStore, NotFound, StoreError, Unavailable, error_from_status
from .keys import (CHUNK_BYTES, MAX_MESSAGE_BYTES, DocumentKey, FetchedShard, Range, Reason, ShardSpec,  # noqa: F401
                   new_hasher)
from .pb import artifact_store_pb2 as pb
from .pb import artifact_store_pb2_grpc as pb_grpc

log = logging.getLogger("redknot.store.client")
Blob = bytes | os.PathLike | str


@dataclass(frozen=True)
class TlsConfig:
    root_ca: bytes | None = None          # PEM CA that signed the server (None: system roots)
    cert: bytes | None = None             # PEM client certificate (mTLS)
    key: bytes | None = None              # PEM client key (mTLS)
    server_name: str | None = None        # override the name checked against the server certificate


@dataclass(frozen=True)
class FetchRankResult:
    directory: Path
    generation: int
    files: tuple[str, ...]
    bytes: int


def fallback_reason(err: StoreError) -> Reason:
    """The fallback a worker records when a store call fails (SPEC §6)."""
    if isinstance(err, NotFound):
        return Reason.MISSING_SHARD
    if isinstance(err, DataLoss):
        return Reason.DIGEST_MISMATCH
    return Reason.STORE_UNAVAILABLE


def _parsed(convert: Callable, m, what: str):
    """A response message converted to the store's types. One that does not convert (an unknown shard kind, say)
    came back altered: DataLoss (fallback digest_mismatch), not a StoreError read as store_unavailable."""
    try:
        return convert(m)
    except (StoreError, ValueError, KeyError) as e:
        raise DataLoss(f"the store's {what} is malformed: {e}") from None


def _chunks_of(blob: Blob) -> Iterator[bytes]:
    if isinstance(blob, (bytes, bytearray, memoryview)):
        mv = memoryview(blob)
        for i in range(0, len(mv), CHUNK_BYTES):
            yield bytes(mv[i:i + CHUNK_BYTES])
        return
    with open(blob, "rb") as f:
        while data := f.read(CHUNK_BYTES):
            yield data


class StoreClient:
    def __init__(self, target: str, token: str, *, tls: TlsConfig | None = None, timeout_s: float = 300.0,
                 options: Sequence[tuple[str, object]] = (), local_socket: str | os.PathLike | None = None):
        """`local_socket`: the store's local socket on this host (`--local-socket`); `fetch` then goes through it
        (local_client.py: descriptors instead of a byte stream, verified here), everything else over gRPC. Where no
        store listens on it (the store runs on another node), `fetch` takes gRPC too."""
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), *options]
        if tls is not None:
            if tls.server_name:
                opts.append(("grpc.ssl_target_name_override", tls.server_name))
            creds = grpc.ssl_channel_credentials(tls.root_ca, tls.key, tls.cert)
            self.channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self.channel = grpc.insecure_channel(target, options=opts)
        self.stub = pb_grpc.ArtifactStoreServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.timeout_s = timeout_s
        self.target, self.local, self._warned_local = target, None, False
        if local_socket is not None:
            from .local_client import LocalStoreClient
            self.local = LocalStoreClient(local_socket, token, timeout_s=timeout_s)

    def close(self) -> None:
        self.channel.close()
        if self.local is not None:
            self.local.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, fn: Callable, request, **kw):
        try:
            return fn(request, metadata=self.metadata, timeout=kw.pop("timeout", self.timeout_s), **kw)
        except grpc.RpcError as e:
            raise error_from_status(e.code(), e.details() or "") from None

    # ------------------------------------------------------------------------------------------- writing
    def begin(self, key: DocumentKey, shards: Sequence[ShardSpec], generation: int = 0) -> BeginResult:
        r = self._call(self.stub.BeginGeneration, pb.BeginGenerationRequest(
            key=wire.key_to_pb(key), generation=generation, shards=[wire.shard_to_pb(s) for s in shards]))
        return BeginResult(r.generation, r.upload_id, tuple((s.rank, s.name) for s in r.already_stored),
                           r.expires_at_unix_ms)

    def put(self, upload_id: str, shards: Iterable[tuple[ShardSpec, Blob]]) -> PutResult:
        """Stream the given shards' bytes in order, in chunks of at most 4 MiB, on one stream."""
        def requests():
            for spec, blob in shards:
                offset, sent_last = 0, False
                for data in _chunks_of(blob):
                    last = offset + len(data) >= spec.size
                    yield pb.PutShardsRequest(upload_id=upload_id, rank=spec.rank, name=spec.name, offset=offset,
                                              data=data, last=last)
                    offset += len(data)
                    sent_last = sent_last or last
                if not sent_last:      # empty shard, or fewer bytes than declared (the server refuses that)
                    yield pb.PutShardsRequest(upload_id=upload_id, rank=spec.rank, name=spec.name, offset=offset,
                                              last=True)

        r = self._call(self.stub.PutShards, requests())
        return PutResult(tuple((s.rank, s.name) for s in r.stored), r.bytes)

    def commit(self, upload_id: str) -> CommitResult:
        r = self._call(self.stub.CommitGeneration, pb.CommitGenerationRequest(upload_id=upload_id))
        return CommitResult(_parsed(wire.manifest_from_pb, r.manifest, "manifest"), r.became_current,
                            r.current_generation)

    def put_generation(self, key: DocumentKey, shards: Sequence[tuple[ShardSpec, Blob]],
                       generation: int = 0) -> CommitResult:
        """Begin, upload the shards the store does not hold yet, commit: all of the generation or none."""
        b = self.begin(key, [s for s, _ in shards], generation)
        have = set(b.already_stored)
        todo = [(s, blob) for s, blob in shards if s.ref not in have]
        if todo:
            self.put(b.upload_id, todo)
        return self.commit(b.upload_id)

    def put_artifact(self, rank_dirs: Iterable[str | os.PathLike]) -> CommitResult:
        """Upload one generation from every rank's artifact directory (written by runtime.reuse.store); the
        generation is the certificates'."""
        from .artifact_dir import read_generation
        key, generation, shards = read_generation(rank_dirs)
        return self.put_generation(key, shards, generation)

    # ------------------------------------------------------------------------------------------- reading
    def manifest(self, key: DocumentKey, generation: int = 0) -> ManifestResult:
        r = self._call(self.stub.GetManifest, pb.GetManifestRequest(key=wire.key_to_pb(key), generation=generation))
        return ManifestResult(_parsed(wire.manifest_from_pb, r.manifest, "manifest"), r.current_generation,
                              tuple(r.generations))

    def fetch(self, key: DocumentKey, rank: int, *, generation: int = 0, layers: Range | None = None,
              channels: Range | None = None, names: Sequence[str] = (), verify: bool = True
              ) -> Iterator[FetchedShard]:
        """Shards of one rank of one generation (the current one by default, resolved once by the server).
        The server verified every shard before its last chunk; `verify` hashes it again here (end to end), which
        a caller that re-checks digests itself (load_artifact does) may turn off. With `local_socket`, the shards
        come through it and are always verified here (the store only checks their sizes there)."""
        if self.local is not None:
            try:
                yield from self.local.fetch(key, rank, generation=generation, layers=layers, channels=channels,
                                            names=names)
                return
            except NoLocalStore as e:                       # raised at connect, before any shard was yielded
                if not self._warned_local:
                    self._warned_local = True
                    log.warning("%s: fetching from %s over gRPC instead", e, self.target)
        req = pb.FetchShardsRequest(key=wire.key_to_pb(key), generation=generation, rank=rank, names=list(names))
        if layers is not None:
            req.layers.CopyFrom(wire.range_to_pb(layers))
        if channels is not None:
            req.channels.CopyFrom(wire.range_to_pb(channels))
        stream = self._call(self.stub.FetchShards, req)
        spec, parts, size = None, [], 0
        try:
            for m in stream:
                if m.HasField("shard"):
                    if spec is not None:
                        raise DataLoss(f"shard {spec.name!r} ended without its last chunk")
                    spec, parts, size = _parsed(wire.shard_from_pb, m.shard, "shard spec"), [], 0
                if spec is None or m.offset != size:
                    raise DataLoss("fetch stream out of order")
                if m.data:
                    parts.append(m.data)
                    size += len(m.data)
                if m.last:
                    data = parts[0] if len(parts) == 1 else b"".join(parts)      # no copy for one chunk
                    if len(data) != spec.size:
                        raise DataLoss(f"shard {spec.name!r} arrived with {len(data)} of {spec.size} bytes")
                    if verify:
                        h = new_hasher()
                        h.update(data)
                        if h.hexdigest() != spec.digest:
                            raise DataLoss(f"shard {spec.name!r} arrived corrupt")
                    yield FetchedShard(spec, m.generation, data)
                    spec, parts = None, []
        except grpc.RpcError as e:
            raise error_from_status(e.code(), e.details() or "") from None
        finally:
            stream.cancel()
        if spec is not None:
            raise DataLoss(f"shard {spec.name!r} ended without its last chunk")

    def fetch_rank(self, key: DocumentKey, rank: int, directory: str | os.PathLike, *,
                   generation: int = 0) -> FetchRankResult:
        """Every shard of `rank` into `directory` as an artifact directory (certificate written last, published
        by one rename), ready for runtime.reuse.store.load_artifact."""
        from .artifact_dir import write_rank_dir
        files, gens = [], set()
        for s in self.fetch(key, rank, generation=generation):
            files.append((s.spec.name, s.data))
            gens.add(s.generation)
        if not files:
            raise NotFound(f"rank {rank} has no shards")
        assert len(gens) == 1, gens          # the server resolves the generation once per stream
        path = write_rank_dir(directory, files)
        return FetchRankResult(path, gens.pop(), tuple(sorted(n for n, _ in files)), sum(len(d) for _, d in files))

    def validate(self, key: DocumentKey, rank: int, *, channels: Range | None = None,
                 layers_needed: Iterable[int] = (), generation: int = 0, certificate_digest: str = "",
                 deep: bool = False) -> Verdict:
        """The store's verdict for this rank; an unreachable store is a STORE_UNAVAILABLE verdict, not an error,
        so every rank can take part in the agreement collective either way."""
        req = pb.ValidateCertificateRequest(key=wire.key_to_pb(key), tp_rank=rank, layers_needed=list(layers_needed),
                                            generation=generation, certificate_digest=certificate_digest, deep=deep)
        if channels is not None:
            req.channels.CopyFrom(wire.range_to_pb(channels))
        try:
            r = self._call(self.stub.ValidateCertificate, req)
        except Unavailable as e:
            return Verdict(False, Reason.STORE_UNAVAILABLE, str(e))
        return Verdict(r.ok, wire.REASON_FROM_PB.get(r.reason), r.detail, r.current_generation, r.certificate_digest)

    def list_documents(self, doc_hash: str = "", page_size: int = 100) -> list[DocumentSummary]:
        out, token = [], ""
        while True:
            r = self._call(self.stub.ListDocuments, pb.ListDocumentsRequest(page_size=page_size, page_token=token,
                                                                             doc_hash=doc_hash))
            out += [DocumentSummary(wire.key_from_pb(d.key), d.current_generation, tuple(d.generations))
                    for d in r.documents]
            token = r.next_page_token
            if not token:
                return out

    def retire(self, key: DocumentKey, generation: int) -> int:
        return self._call(self.stub.RetireGeneration, pb.RetireGenerationRequest(
            key=wire.key_to_pb(key), generation=generation)).current_generation

    def collect_garbage(self, key: DocumentKey | None = None) -> GcResult:
        req = pb.CollectGarbageRequest()
        if key is not None:
            req.key.CopyFrom(wire.key_to_pb(key))
        r = self._call(self.stub.CollectGarbage, req)
        return GcResult(r.blobs_deleted, r.bytes_freed, r.blobs_kept, r.temp_files_removed)

    # ------------------------------------------------------------------------------- calibration records
    def put_calibration(self, record: bytes) -> StoredCalibration:
        """Store a calibration record (JSON bytes, as `redknot calibrate` writes them) for the whole deployment,
        under the checkpoint and profile it names; the token must be one of the store's admin tenants'."""
        r = self._call(self.stub.PutCalibration, pb.PutCalibrationRequest(record=record))
        return StoredCalibration(CalibrationKey(r.key.checkpoint_fingerprint, r.key.profile), r.digest,
                                 r.stored_at_unix_ms, r.replaced)

    def get_calibration(self, key: CalibrationKey) -> CalibrationEntry:
        """The record stored for (checkpoint fingerprint, profile id); NotFound when none. Its bytes are checked
        against their digest here too (DataLoss otherwise)."""
        r = self._call(self.stub.GetCalibration, pb.GetCalibrationRequest(key=pb.CalibrationKey(
            checkpoint_fingerprint=key.checkpoint_fingerprint, profile=key.profile)))
        h = new_hasher()
        h.update(r.record)
        if h.hexdigest() != r.digest:
            raise DataLoss("the calibration record arrived corrupt")
        return CalibrationEntry(r.record, r.digest, r.stored_at_unix_ms, r.stored_by)
