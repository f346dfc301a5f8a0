"""A runtime artifact directory (runtime/reuse/store.py, format 1) seen as store shards, and back.

One directory is one TP rank's artifact: `manifest.msgpack`, `layerNN.latent.safetensors`,
`layerNN.local.rR.cLO-HI.safetensors` and `certificate.msgpack`. Each file becomes one shard named by its
file name; the certificate supplies the document key, the generation and every other shard's digest, and
its own digest is computed here. Only the client imports this module (it needs the runtime, hence torch)."""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack

from runtime.reuse.certificate import Certificate, digest_bytes
from runtime.reuse.store import CERTIFICATE_FILE, MANIFEST, MANIFEST_FILE, shard_file, write_atomic

from .keys import DocumentKey, Range, ShardKind, ShardSpec, content_hash, profile_id


@dataclass(frozen=True)
class RankDir:
    path: Path
    certificate: Certificate
    shards: tuple[tuple[ShardSpec, Path], ...]
    n_content: int                      # the document's unpadded length (its manifest's)


def document_key(cert: Certificate, n_content: int) -> DocumentKey:
    """The store key of the artifact `cert` certifies, for a document of `n_content` unpadded tokens
    (`keys.content_hash`: the same key `serving.Binding.store_key` gives its tokens)."""
    return DocumentKey(content_hash(cert.token_hash, n_content), cert.checkpoint_fingerprint,
                       profile_id(cert.profile), cert.tp_size)


def read_rank_dir(path: str | os.PathLike) -> RankDir:
    """Shard specs of one rank's artifact directory. Sizes come from the files; digests from the certificate,
    so the store's check on write also proves the files are the certified ones."""
    path = Path(path)
    raw = (path / CERTIFICATE_FILE).read_bytes()
    cert = Certificate.from_bytes(raw)
    m = msgpack.unpackb((path / MANIFEST_FILE).read_bytes(), raw=False, strict_map_key=False)
    rank = cert.tp_rank

    def spec(name: str, kind: ShardKind, digest: str, layers=Range(), channels=Range()) -> tuple[ShardSpec, Path]:
        f = path / name
        return ShardSpec(name, rank, kind, digest, f.stat().st_size, layers, channels), f

    shards = [spec(MANIFEST_FILE, ShardKind.MANIFEST, cert.shard_digests[MANIFEST]),
              spec(CERTIFICATE_FILE, ShardKind.CERTIFICATE, digest_bytes(raw))]
    for s in m["shards"]:
        kind = ShardKind.LOCAL if s["kind"] == "local" else ShardKind.LATENT
        channels = Range(*cert.channel_range) if kind is ShardKind.LOCAL else Range()
        shards.append(spec(shard_file(s["name"]), kind, cert.shard_digests[s["name"]],
                           Range(s["layer"], s["layer"] + 1), channels))
    return RankDir(path, cert, tuple(shards), m["n_content"])


def read_generation(dirs: Iterable[str | os.PathLike]) -> tuple[DocumentKey, int, list[tuple[ShardSpec, Path]]]:
    """Every rank's directory of one generation: (key, generation, shards). The certificates must bind the
    same artifact (same binding digest) and cover ranks 0..tp_size-1 exactly once."""
    ranks = [read_rank_dir(d) for d in dirs]
    if not ranks:
        raise ValueError("no artifact directories given")
    first = ranks[0].certificate
    bindings = {r.certificate.binding_digest() for r in ranks}
    if len(bindings) != 1:
        raise ValueError(f"artifact directories bind {len(bindings)} different artifacts (certificates differ "
                         "in checkpoint, tokens, profile, TP size, layers, dtype, producer or generation)")
    have = sorted(r.certificate.tp_rank for r in ranks)
    if have != list(range(first.tp_size)):
        raise ValueError(f"ranks {have} do not cover tp_size {first.tp_size} exactly once")
    if first.generation < 1:
        raise ValueError(f"certificate generation {first.generation}: the store numbers generations from 1")
    if len({r.n_content for r in ranks}) != 1:
        raise ValueError(f"the ranks' manifests disagree on the document's length: {[r.n_content for r in ranks]}")
    return document_key(first, ranks[0].n_content), first.generation, [s for r in ranks for s in r.shards]


def write_rank_dir(directory: str | os.PathLike, files: Sequence[tuple[str, bytes]]) -> Path:
    """Publish fetched shards as an artifact directory: into a fresh sibling, certificate last, every file
    fsynced, then one rename, so `directory` never holds a partial artifact."""
    directory = Path(directory)
    if directory.exists():
        raise FileExistsError(f"{directory} exists; artifacts are immutable")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.{uuid.uuid4().hex}.partial"
    tmp.mkdir()
    try:
        for name, data in sorted(files, key=lambda f: f[0] == CERTIFICATE_FILE):
            write_atomic(tmp, name, data)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, directory)
    except BaseException:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
        raise
    return directory
