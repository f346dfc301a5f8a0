"""One document's artifact for one TP rank as a directory (format version 1):

    manifest.msgpack                                  format, tokens, n_content, tp geometry, meta, shard table
    layer{L:02d}.latent.safetensors                   rank-agnostic: latent, entries, index_keys, *_prev kv/gate
    layer{L:02d}.local.r{rank}.c{lo}-{hi}.safetensors reusable layers: local_p (local_s: its FP8 scales), this rank's
                                                      channel range
    layer{L:02d}.kv.safetensors                       the Llama family's layers instead of a latent shard: k, v
                                                      (`KVLayerArtifact`; its local shard holds W_o,L O_L)
    certificate.msgpack                               written LAST: a directory without it is not an artifact

Every file is written to a temp name, fsynced and renamed. The certificate holds the blake3 digest of every
shard's exact bytes (the manifest included, under the name "manifest"); `load_artifact` recomputes them on
the bytes it then parses, so what is verified is what is used."""
from __future__ import annotations

import json
import math
import os
import re
import warnings
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import safetensors.torch
import torch

from runtime.model.quant import FP8_ROW_BLOCK
from .artifact import DocumentArtifact, KVLayerArtifact, LayerArtifact
from .certificate import Certificate, CertificateError, FallbackReason, Verdict, digest_bytes, validate

FORMAT_VERSION = 1
MANIFEST = "manifest"
MANIFEST_FILE = "manifest.msgpack"
CERTIFICATE_FILE = "certificate.msgpack"
CERT_FIELDS = ("fingerprint", "token_hash", "profile", "channel_range", "dtype", "producer_version", "generation")
EXPECT_FIELDS = ("fingerprint", "tokens_hash", "profile", "tp_size", "tp_rank", "channel_range", "layers_needed",
                 "current_generation", "dtype", "producer_version")
_SHARD_NAME = re.compile(r"^layer(\d{2,})\.(latent|kv|local\.r(\d+)\.c(\d+)-(\d+))$")


def latent_shard(layer: int) -> str:
    return f"layer{layer:02d}.latent"


def kv_shard(layer: int) -> str:
    return f"layer{layer:02d}.kv"


def local_shard(layer: int, rank: int, channel_range: tuple[int, int]) -> str:
    lo, hi = channel_range
    return f"layer{layer:02d}.local.r{rank}.c{lo}-{hi}"


def shard_file(name: str) -> str:
    # file names follow from shard names, so a reader never needs unverified data to find a file
    return MANIFEST_FILE if name == MANIFEST else name + ".safetensors"


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _latent_tensors(la: LayerArtifact) -> dict[str, torch.Tensor]:
    out = {"latent": la.latent}
    if la.entries is not None:
        out["entries"] = la.entries
    if la.index_keys is not None:
        out["index_keys"] = la.index_keys
    if la.picks is not None:
        out["picks"] = la.picks
    for prefix, pair in (("comp_prev", la.comp_prev), ("index_prev", la.index_prev)):
        if pair is not None:
            out[f"{prefix}.kv"], out[f"{prefix}.gate"] = pair
    return out


# ----------------------------------------------------------------------------------------------------- writing

def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(directory: Path, file: str, data: bytes) -> None:
    """`directory / file` holds `data` whole or not at all: written to a temp name, fsynced, renamed (the
    directory's own fsync is the caller's, once for all its files)."""
    tmp = directory / f".{file}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / file)
    finally:
        tmp.unlink(missing_ok=True)


def save_artifact(art: DocumentArtifact, directory: str | os.PathLike, cert_fields: dict) -> Certificate:
    """Write `art` and certify it. `cert_fields`: fingerprint, token_hash, profile (dict or ReuseProfile),
    channel_range, dtype, producer_version, generation. Artifacts are immutable: an existing certificate in
    `directory` is an error, while leftovers of an uncertified (crashed) write are overwritten."""
    missing = [k for k in CERT_FIELDS if k not in cert_fields]
    if missing:
        raise ValueError(f"cert_fields lacks {missing}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / CERTIFICATE_FILE).exists():
        raise FileExistsError(f"{directory} already holds a certified artifact; artifacts are immutable")
    lo, hi = (int(c) for c in cert_fields["channel_range"])
    if not 0 <= lo <= hi:
        raise ValueError(f"channel_range ({lo}, {hi}) is not 0 <= lo <= hi")
    if not 0 <= art.tp_rank < art.tp_size:
        raise ValueError(f"tp_rank {art.tp_rank} outside tp_size {art.tp_size}")
    profile = cert_fields["profile"]
    profile = profile.to_dict() if hasattr(profile, "to_dict") else dict(profile)

    shards, digests = [], {}
    for layer, la in enumerate(art.layers):
        if isinstance(la, KVLayerArtifact):
            if la.k.shape[0] != art.n or la.v.shape != la.k.shape:
                raise ValueError(f"layer {layer}: k {tuple(la.k.shape)} / v {tuple(la.v.shape)} for {art.n} tokens")
            parts = [(kv_shard(layer), "kv", {"k": la.k, "v": la.v})]
        elif la.latent.shape[0] != art.n:
            raise ValueError(f"layer {layer}: latent has {la.latent.shape[0]} rows for {art.n} tokens")
        else:
            parts = [(latent_shard(layer), "latent", _latent_tensors(la))]
        if la.local_p is not None:
            if tuple(la.local_p.shape) != (art.n, hi - lo):
                raise ValueError(f"layer {layer}: local_p {tuple(la.local_p.shape)} does not match "
                                 f"{art.n} rows x channels [{lo}, {hi})")
            local = {"local_p": la.local_p}
            if getattr(la, "local_s", None) is not None:
                nb = -(-(hi - lo) // FP8_ROW_BLOCK)
                if tuple(la.local_s.shape) != (art.n, nb) or la.local_s.dtype != torch.uint8:
                    raise ValueError(f"layer {layer}: local_s {tuple(la.local_s.shape)} {la.local_s.dtype} is not "
                                     f"uint8 [{art.n}, ceil({hi - lo}/{FP8_ROW_BLOCK})]")
                local["local_s"] = la.local_s
            parts.append((local_shard(layer, art.tp_rank, (lo, hi)), "local", local))
        for name, kind, tensors in parts:
            # clone: safetensors refuses tensors that share storage (e.g. kv/gate views of one buffer)
            tensors = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
            data = safetensors.torch.save(tensors)
            write_atomic(directory, shard_file(name), data)
            digests[name] = digest_bytes(data)
            shards.append({"name": name, "file": shard_file(name), "layer": layer, "kind": kind,
                           "tensors": {k: [list(v.shape), _dtype_name(v)] for k, v in sorted(tensors.items())},
                           "digest": digests[name]})

    manifest = {"format": FORMAT_VERSION, "tokens": [int(t) for t in art.tokens], "n_content": int(art.n_content),
                "n_layers": len(art.layers), "tp_rank": art.tp_rank, "tp_size": art.tp_size, "meta": art.meta,
                "shards": shards}
    try:
        data = msgpack.packb(manifest, use_bin_type=True)
    except TypeError as e:
        raise TypeError(f"artifact meta must be msgpack-serializable: {e}") from None
    write_atomic(directory, MANIFEST_FILE, data)
    digests[MANIFEST] = digest_bytes(data)
    _fsync_dir(directory)        # every shard is durable before the certificate can name it

    cert = Certificate(checkpoint_fingerprint=cert_fields["fingerprint"], token_hash=cert_fields["token_hash"],
                       n_tokens=art.n, profile=profile, tp_size=art.tp_size, tp_rank=art.tp_rank,
                       channel_range=(lo, hi), layers=tuple(range(len(art.layers))), dtype=str(cert_fields["dtype"]),
                       producer_version=str(cert_fields["producer_version"]), shard_digests=digests,
                       generation=int(cert_fields["generation"]))
    assert not cert.problems(), cert.problems()
    write_atomic(directory, CERTIFICATE_FILE, cert.to_bytes())
    _fsync_dir(directory)
    return cert


# ----------------------------------------------------------------------------------------------------- reading

class _Reject(Exception):
    """Internal control flow: carries a reject verdict out of the reading helpers."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.detail)
        self.verdict = verdict


def _reject(reason: FallbackReason, detail: str) -> _Reject:
    return _Reject(Verdict.reject(reason, detail))


def _read_certificate(directory: Path) -> Certificate:
    R = FallbackReason
    if not directory.exists():
        raise _reject(R.MISSING_SHARD, f"no artifact directory {directory}")
    try:
        raw = (directory / CERTIFICATE_FILE).read_bytes()
    except FileNotFoundError:
        raise _reject(R.MISSING_SHARD, f"{directory} has no certificate (incomplete write)") from None
    except OSError as e:
        raise _reject(R.STORE_UNAVAILABLE, f"certificate unreadable: {type(e).__name__}: {e}") from None
    try:
        return Certificate.from_bytes(raw)
    except CertificateError as e:
        raise _reject(R.MISSING_SHARD, f"certificate unreadable: {e}") from None


def _read_shard(directory: Path, name: str) -> bytearray | None:
    """The file's bytes, writable: the parsed tensors are views of them (`_safetensors_views`), and a caller may own
    the artifact `load_artifact` returns."""
    try:
        with open(directory / shard_file(name), "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            n = f.readinto(data)
            return data if n == len(data) else data[:n]
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _reject(FallbackReason.STORE_UNAVAILABLE, f"shard {name} unreadable: {type(e).__name__}: {e}") from None


def _check_manifest(raw: bytes, cert: Certificate) -> dict:
    """The manifest's bytes match the certificate; here it must also agree with the certificate's fields."""
    def bad(detail: str) -> _Reject:
        return _reject(FallbackReason.DIGEST_MISMATCH, "manifest inconsistent with certificate: " + detail)

    try:
        m = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as e:      # certified bytes that do not decode: a producer bug, still never a crash here
        raise bad(f"does not decode ({type(e).__name__})") from None
    if not isinstance(m, dict):
        raise bad("not a map")
    if m.get("format") != FORMAT_VERSION:
        raise _reject(FallbackReason.STORE_UNAVAILABLE,
                      f"artifact format {m.get('format')!r}, this runtime reads {FORMAT_VERSION}")
    try:
        if len(m["tokens"]) != cert.n_tokens or (m["tp_rank"], m["tp_size"]) != (cert.tp_rank, cert.tp_size):
            raise bad("tokens or tp geometry")
        if tuple(range(m["n_layers"])) != cert.layers:
            raise bad("layer set")
        if not (isinstance(m["n_content"], int) and isinstance(m["meta"], dict)):
            raise bad("n_content or meta")
        names = {s["name"] for s in m["shards"]}
        if names | {MANIFEST} != set(cert.shard_digests):
            raise bad("shard set")
        for s in m["shards"]:
            if (s["file"] != shard_file(s["name"]) or s["digest"] != cert.shard_digests[s["name"]]
                    or not isinstance(s["tensors"], dict)):
                raise bad(f"shard {s['name']} entry")
            want = (local_shard(s["layer"], cert.tp_rank, cert.channel_range) if s["kind"] == "local"
                    else kv_shard(s["layer"]) if s["kind"] == "kv" else latent_shard(s["layer"]))
            if s["name"] != want:
                raise bad(f"shard {s['name']} is not {want}")
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"{type(e).__name__}: {e}") from None
    return m


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
if hasattr(torch, "float8_e8m0fnu"):
    _ST_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


def safetensors_spans(head, size: int) -> tuple[int, list[tuple[int, int, str, torch.dtype, list[int]]]]:
    """The layout of a safetensors file of `size` bytes from its first bytes `head` (at least its 8-byte header
    length and the header; more is ignored): (where the data section starts, [(begin, end, name, dtype, shape)]
    in data order, offsets relative to the data section). Checked as strictly as safetensors checks it: JSON of
    tensors with a known dtype, a shape of non-negative ints and data offsets that tile the data section exactly, in
    order. ValueError otherwise (json's errors are ValueErrors)."""
    mv = memoryview(head).cast("B")
    if len(mv) < 8 or size < 8:
        raise ValueError("shorter than its header length")
    n = int.from_bytes(mv[:8], "little")
    if n > size - 8:
        raise ValueError(f"header length {n} past the end ({size} bytes)")
    if n > len(mv) - 8:
        raise ValueError(f"header of {n} bytes not read ({len(mv) - 8} given)")
    header = json.loads(bytes(mv[8:8 + n]))
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    header.pop("__metadata__", None)
    base, data = 8 + n, size - 8 - n
    spans = []
    for k, e in header.items():
        if not isinstance(e, dict) or e.get("dtype") not in _ST_DTYPES:
            raise ValueError(f"tensor {k!r}: unknown dtype {e.get('dtype') if isinstance(e, dict) else e!r}")
        shape, offs = e.get("shape"), e.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) for o in offs)):
            raise ValueError(f"tensor {k!r}: bad shape or data_offsets")
        dt = _ST_DTYPES[e["dtype"]]
        if offs[1] - offs[0] != math.prod(shape) * dt.itemsize:
            raise ValueError(f"tensor {k!r}: {offs[1] - offs[0]} bytes for shape {shape} {e['dtype']}")
        spans.append((offs[0], offs[1], k, dt, shape))
    spans.sort()
    if [b for b, *_ in spans] != [0] + [e for _, e, *_ in spans[:-1]] or (spans[-1][1] if spans else 0) != data:
        raise ValueError("data offsets do not tile the data section")
    return base, spans


def check_tensors(name: str, got: dict[str, tuple[list[int], torch.dtype]], entry: dict) -> None:
    """A shard's tensors (name -> (shape, dtype)) against its manifest entry; a mismatch rejects the shard."""
    seen = {k: [list(shape), str(dt).removeprefix("torch.")] for k, (shape, dt) in got.items()}
    if seen != entry["tensors"]:
        raise _reject(FallbackReason.DIGEST_MISMATCH, f"shard {name} tensors {seen} != manifest {entry['tensors']}")


def _safetensors_views(raw) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `raw` (bytes, bytearray or a memoryview), as VIEWS of its bytes:
    no copy. `safetensors.torch.load` copies every tensor out of the file's bytes while it holds the GIL, so the
    worker's staging threads copied one at a time. The header is checked by `safetensors_spans`. A tensor whose
    offset is not a multiple of its element size is copied (safetensors' writer aligns them; this keeps any valid
    file readable). Views of read-only bytes must not be written: whoever writes copies first (`StagedSource.read`
    pins every layer, `load_artifact` reads into a bytearray)."""
    mv = memoryview(raw).cast("B")
    base, spans = safetensors_spans(mv, len(mv))
    with warnings.catch_warnings():         # read-only bytes: the views are never written (see above)
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mv, dtype=torch.uint8)          # never empty: the header length is there
    out = {}
    for b, e, k, dt, shape in spans:
        t = flat[base + b:base + e]
        if (base + b) % dt.itemsize:
            t = t.clone()
        out[k] = t.view(dt).view(shape)
    return out


def _parse_shard(name: str, raw, entry: dict) -> dict[str, torch.Tensor]:
    try:
        tensors = _safetensors_views(raw)
    except (ValueError, RuntimeError) as e:     # json's errors are ValueErrors
        raise _reject(FallbackReason.DIGEST_MISMATCH, f"shard {name} does not parse: {e}") from None
    check_tensors(name, {k: (list(v.shape), v.dtype) for k, v in tensors.items()}, entry)
    return tensors


def _layer(m: dict, layer: int, parsed: dict[str, dict[str, torch.Tensor]]) -> LayerArtifact | KVLayerArtifact:
    local = [s["name"] for s in m["shards"] if s["layer"] == layer and s["kind"] == "local"]
    assert len(local) <= 1, local
    if kv_shard(layer) in parsed:                   # the Llama family's layer
        kv = parsed[kv_shard(layer)]
        if "k" not in kv or "v" not in kv:
            raise _reject(FallbackReason.DIGEST_MISMATCH, f"layer {layer} kv shard lacks k or v")
        return KVLayerArtifact(kv["k"], kv["v"], parsed[local[0]]["local_p"] if local else None,
                               parsed[local[0]].get("local_s") if local else None)
    if latent_shard(layer) not in parsed:
        raise _reject(FallbackReason.MISSING_SHARD, f"layer {layer} has neither a latent nor a kv shard")
    lat = parsed[latent_shard(layer)]
    if "latent" not in lat:
        raise _reject(FallbackReason.DIGEST_MISMATCH, f"layer {layer} latent shard has no latent")

    def pair(p: str):
        return (lat[f"{p}.kv"], lat[f"{p}.gate"]) if f"{p}.kv" in lat else None

    return LayerArtifact(latent=lat["latent"], entries=lat.get("entries"), index_keys=lat.get("index_keys"),
                         comp_prev=pair("comp_prev"), index_prev=pair("index_prev"), picks=lat.get("picks"),
                         local_p=parsed[local[0]]["local_p"] if local else None,
                         local_s=parsed[local[0]].get("local_s") if local else None)


def _build(m: dict, parsed: dict[str, dict[str, torch.Tensor]]) -> DocumentArtifact:
    return DocumentArtifact(tokens=list(m["tokens"]), n_content=m["n_content"],
                            layers=[_layer(m, i, parsed) for i in range(m["n_layers"])],
                            tp_rank=m["tp_rank"], tp_size=m["tp_size"], meta=m["meta"])


def _checks(expect: dict) -> dict:
    missing = [k for k in EXPECT_FIELDS if k not in expect]
    if missing:
        raise ValueError(f"expect lacks {missing}")
    return dict(fingerprint=expect["fingerprint"], tokens_hash=expect["tokens_hash"], profile=expect["profile"],
                tp_size=expect["tp_size"], tp_rank=expect["tp_rank"], channel_range=tuple(expect["channel_range"]),
                layers_needed=set(expect["layers_needed"]), current_generation=expect["current_generation"],
                dtype=expect["dtype"], producer_version=expect["producer_version"])


def _validate_head(cert: Certificate, checks: dict) -> Verdict:
    """Everything a certificate says about itself and its binding, before any shard is read."""
    verdict = validate(cert, **checks)
    if not verdict.ok:
        return verdict
    return _validate_format(cert)


def _validate_format(cert: Certificate) -> Verdict:
    """A well-formed certificate of this format (its binding not checked)."""
    if not isinstance(cert, Certificate) or cert.problems():
        return Verdict.reject(FallbackReason.MISSING_SHARD, "malformed certificate: " + "; ".join(
            cert.problems() if isinstance(cert, Certificate) else [type(cert).__name__]))
    odd = [n for n in cert.shard_digests if n != MANIFEST and not _SHARD_NAME.match(n)]
    if odd or MANIFEST not in cert.shard_digests:
        return Verdict.reject(FallbackReason.MISSING_SHARD,
                              f"certificate names shards outside format {FORMAT_VERSION}: {odd or 'no manifest'}")
    return Verdict.accept()


def load_artifact(directory: str | os.PathLike, expect: dict) -> tuple[DocumentArtifact | None, Verdict]:
    """The artifact in `directory` if its certificate validates against `expect` (fingerprint, tokens_hash,
    profile, tp_size, tp_rank, channel_range, layers_needed, current_generation) and every shard's bytes
    match their certified digest; otherwise (None, reject). Store content never raises; a bad `expect` does."""
    directory = Path(directory)
    checks = _checks(expect)
    try:
        cert = _read_certificate(directory)
        verdict = _validate_head(cert, checks)      # cheap reject before reading any shard
        if not verdict.ok:
            return None, verdict

        # digest every shard in validate's order; stop at the first missing or altered one
        seen, raw = {}, {}
        for name in sorted(cert.shard_digests):
            data = _read_shard(directory, name)
            if data is None:
                break
            seen[name] = digest_bytes(data)
            if seen[name] != cert.shard_digests[name]:
                break
            raw[name] = data
        verdict = validate(cert, **checks, shard_digests_seen=seen)
        if not verdict.ok:
            return None, verdict

        m = _check_manifest(raw.pop(MANIFEST), cert)
        entries = {s["name"]: s for s in m["shards"]}
        parsed = {name: _parse_shard(name, data, entries[name]) for name, data in raw.items()}
        return _build(m, parsed), verdict
    except _Reject as r:
        return None, r.verdict


# ------------------------------------------------------------------------------------ reading layer by layer

@dataclass(frozen=True)
class ArtifactHead:
    """A rank artifact's certificate and manifest, both verified: what `read_layers` checks each layer
    group's shard bytes against, so that layers can be consumed as they arrive."""
    certificate: Certificate
    manifest: dict

    def files(self, layers: Iterable[int]) -> list[str]:
        """File names of the shards of `layers` (the latent shard, and the local one of reusable layers)."""
        want = set(layers)
        return sorted(shard_file(s["name"]) for s in self.manifest["shards"] if s["layer"] in want)

    def document(self, layers: Sequence[LayerArtifact]) -> DocumentArtifact:
        m = self.manifest
        return DocumentArtifact(tokens=list(m["tokens"]), n_content=m["n_content"], layers=layers,
                                tp_rank=m["tp_rank"], tp_size=m["tp_size"], meta=m["meta"])


def read_head(files: Mapping[str, bytes], expect: dict | None) -> tuple[ArtifactHead | None, Verdict]:
    """`load_artifact`'s checks of the certificate and manifest, on their bytes (`files` maps file names to
    bytes): (head, accept) or (None, reject). No layer shard is read: `read_layers` checks those. `expect` None:
    only what the artifact says of itself (a well-formed certificate of this format, the manifest's digest), for a
    cache that checks each request's binding later (`check_binding`)."""
    checks = _checks(expect) if expect is not None else None
    try:
        raw = files.get(CERTIFICATE_FILE)
        if raw is None:
            raise _reject(FallbackReason.MISSING_SHARD, "no certificate")
        try:
            cert = Certificate.from_bytes(raw)
        except CertificateError as e:
            raise _reject(FallbackReason.MISSING_SHARD, f"certificate unreadable: {e}") from None
        verdict = _validate_head(cert, checks) if checks is not None else _validate_format(cert)
        if not verdict.ok:
            return None, verdict
        raw = files.get(MANIFEST_FILE)
        if raw is None:
            raise _reject(FallbackReason.MISSING_SHARD, f"shard {MANIFEST} not found")
        seen = digest_bytes(raw)
        if seen != cert.shard_digests[MANIFEST]:
            raise _reject(FallbackReason.DIGEST_MISMATCH,
                          f"shard {MANIFEST} digest {seen[:16]} != certified {cert.shard_digests[MANIFEST][:16]}")
        return ArtifactHead(cert, _check_manifest(raw, cert)), verdict
    except _Reject as r:
        return None, r.verdict


def check_binding(head: ArtifactHead, expect: dict) -> Verdict:
    """A head read earlier (`read_head(files, None)`) against one request's `expect`: the certificate checks
    `read_head` runs, without reading any bytes again."""
    return _validate_head(head.certificate, _checks(expect))


class VerifiedFiles(dict):
    """File name -> bytes, with `digests`: file name -> the BLAKE3 digest its bytes were already checked against on
    their way here (a store client's end-to-end check, `services.store.client`). `read_layers` then compares that
    digest with the certificate's instead of hashing the bytes a second time. Only code that has just verified the
    bytes may build one."""

    def __init__(self, files: Mapping[str, bytes] = (), digests: Mapping[str, str] | None = None):
        super().__init__(files)
        self.digests = dict(digests or {})


def read_layers(head: ArtifactHead, layers: Sequence[int], files: Mapping[str, bytes]
                ) -> tuple[list[LayerArtifact] | None, Verdict]:
    """The LayerArtifacts of `layers` from their shards' bytes, each verified against the head's certificate
    (missing -> missing_shard, altered -> digest_mismatch, in sorted order); never raises on content. Bytes of a
    `VerifiedFiles` already checked against the certified digest are not hashed again."""
    entries = {s["name"]: s for s in head.manifest["shards"] if s["layer"] in set(layers)}
    known = getattr(files, "digests", {})
    try:
        parsed = {}
        for name in sorted(entries):
            data = files.get(shard_file(name))
            if data is None:
                raise _reject(FallbackReason.MISSING_SHARD, f"shard {name} not found")
            want = head.certificate.shard_digests[name]
            seen = want if known.get(shard_file(name)) == want else digest_bytes(data, parallel=True)
            if seen != want:
                raise _reject(FallbackReason.DIGEST_MISMATCH, f"shard {name} digest {seen[:16]} != certified {want[:16]}")
            parsed[name] = _parse_shard(name, data, entries[name])
        return [_layer(head.manifest, i, parsed) for i in layers], Verdict.accept()
    except _Reject as r:
        return None, r.verdict
