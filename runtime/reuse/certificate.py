"""Certificates: what an artifact is bound to, how a rank checks it, and how TP ranks agree (SPEC §4, §6).

A rank may consume an artifact only when its own `validate` accepts and `agree` (one collective) finds every
TP rank accepting. Any failure is an explicit fallback to full recomputation with a bounded reason label."""
from __future__ import annotations

import enum
import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import blake3
import msgpack
import numpy as np
import torch

from runtime.model.parallel import Parallel

CERT_FORMAT = 1


class FallbackReason(str, enum.Enum):
    """Why a request fell back to full recomputation. Values are Prometheus label values: keep the set fixed."""
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
    PRODUCER_MISMATCH = "producer_mismatch"        # artifact dtype or producer version is not the server's
    UNCALIBRATED = "uncalibrated"                   # no passing calibration record for the checkpoint and profile


# the artifact itself is damaged (not merely another generation, profile or checkpoint): the worker drops its tier
# copy, the API queues the document for a rebuild
BROKEN_ARTIFACT = frozenset({FallbackReason.DIGEST_MISMATCH, FallbackReason.MISSING_SHARD,
                             FallbackReason.MISSING_LAYER})


class CertificateError(ValueError):
    """Certificate bytes that do not decode to a well-formed certificate."""


# ---------------------------------------------------------------------------------------------------- hashing

PARALLEL_DIGEST_BYTES = 1 << 20     # from this size `digest_bytes(..., parallel=True)` hashes with blake3's threads


def digest_bytes(b: bytes | bytearray | memoryview, parallel: bool = False) -> str:
    threads = blake3.blake3.AUTO if parallel and len(b) >= PARALLEL_DIGEST_BYTES else 1
    return blake3.blake3(b, max_threads=threads).hexdigest()


def _field(h: blake3.blake3, b: bytes) -> None:
    # length-prefixed so that concatenations of different fields can never collide
    h.update(len(b).to_bytes(8, "little"))
    h.update(b)


def token_hash(tokens: Iterable[int] | torch.Tensor, tokenizer_fingerprint: str) -> str:
    """blake3 over the token ids as little-endian int64 and the tokenizer fingerprint."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().reshape(-1).tolist()
    ids = np.asarray(list(tokens), dtype="<i8")
    h = blake3.blake3(b"redknot.tokens.v1\0")
    _field(h, ids.tobytes())
    _field(h, tokenizer_fingerprint.encode())
    return h.hexdigest()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # raw storage bytes of any dtype (bf16 / fp8 have no numpy type): view as uint8, no copy when contiguous
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class FingerprintHasher:
    """Streaming checkpoint fingerprint: feed tensors one at a time in strictly increasing name order,
    so a loader can hash each tensor as it reads it and drop it."""

    def __init__(self):
        self._h = blake3.blake3(b"redknot.checkpoint.v1\0")
        self._last: str | None = None

    def add(self, name: str, t: torch.Tensor) -> None:
        assert self._last is None or name > self._last, f"tensors must come in sorted order: {self._last!r} >= {name!r}"
        self._last = name
        _field(self._h, name.encode())
        _field(self._h, json.dumps(list(t.shape)).encode())
        _field(self._h, str(t.dtype).removeprefix("torch.").encode())
        _field(self._h, _tensor_bytes(t))

    def finish(self, config: Mapping, tokenizer_fingerprint: str) -> str:
        self._h.update(b"\0config")
        _field(self._h, _canonical_json(config))
        _field(self._h, tokenizer_fingerprint.encode())
        return self._h.hexdigest()


def _canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()


def model_fingerprint(state: Mapping[str, torch.Tensor], config: Mapping, tokenizer_fingerprint: str) -> str:
    """blake3 over sorted tensor names, shapes, dtypes, bytes; canonical JSON of config; tokenizer fingerprint.
    `state` is only indexed one name at a time, so a lazy mapping streams."""
    h = FingerprintHasher()
    for name in sorted(state):
        h.add(name, state[name])
    return h.finish(config, tokenizer_fingerprint)


# ------------------------------------------------------------------------------------------------ certificate

def _canon(obj):
    """Plain msgpack/JSON shape with sorted dict keys: tuples become lists."""
    if isinstance(obj, Mapping):
        return {k: _canon(obj[k]) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [_canon(v) for v in obj]
    return obj


@dataclass(frozen=True)
class Certificate:
    checkpoint_fingerprint: str
    token_hash: str
    n_tokens: int
    profile: dict                       # ReuseProfile.to_dict()
    tp_size: int
    tp_rank: int
    channel_range: tuple[int, int]      # [lo, hi) of the projected W_a,L O_L channels this rank holds
    layers: tuple[int, ...]             # layer ids with shards
    dtype: str
    producer_version: str
    shard_digests: dict[str, str] = field(default_factory=dict)
    generation: int = 0

    def __post_init__(self):
        # lists (msgpack, callers) become tuples; anything else is left for problems() to report
        for f in ("channel_range", "layers"):
            if isinstance(getattr(self, f), list):
                object.__setattr__(self, f, tuple(getattr(self, f)))

    def to_dict(self) -> dict:
        return {"format": CERT_FORMAT, "checkpoint_fingerprint": self.checkpoint_fingerprint,
                "token_hash": self.token_hash, "n_tokens": self.n_tokens, "profile": _canon(self.profile),
                "tp_size": self.tp_size, "tp_rank": self.tp_rank, "channel_range": list(self.channel_range),
                "layers": list(self.layers), "dtype": self.dtype, "producer_version": self.producer_version,
                "shard_digests": _canon(self.shard_digests), "generation": self.generation}

    def to_bytes(self) -> bytes:
        return msgpack.packb(_canon(self.to_dict()), use_bin_type=True)

    @staticmethod
    def from_bytes(b: bytes) -> "Certificate":
        try:
            d = msgpack.unpackb(b, raw=False)
        except Exception as e:      # msgpack raises several unrelated types on garbage
            raise CertificateError(f"certificate bytes do not decode: {type(e).__name__}: {e}") from None
        if not isinstance(d, dict):
            raise CertificateError(f"certificate is a {type(d).__name__}, not a map")
        if d.get("format") != CERT_FORMAT:
            raise CertificateError(f"certificate format {d.get('format')!r}, this reader knows {CERT_FORMAT}")
        names = [f for f in Certificate.__dataclass_fields__]
        missing = [f for f in names if f not in d]
        if missing:
            raise CertificateError(f"certificate lacks {missing}")
        cert = Certificate(**{f: d[f] for f in names})
        bad = cert.problems()
        if bad:
            raise CertificateError("malformed certificate: " + "; ".join(bad))
        return cert

    def certificate_digest(self) -> str:
        return digest_bytes(self.to_bytes())

    def binding_digest(self) -> str:
        """Digest of the fields every TP rank of one artifact shares (not rank, channel range, shard digests):
        ranks that each accept must also agree on this, or they would be reusing different artifacts."""
        d = self.to_dict()
        for k in ("tp_rank", "channel_range", "shard_digests"):
            d.pop(k)
        return digest_bytes(msgpack.packb(_canon(d), use_bin_type=True))

    def problems(self) -> list[str]:
        """Why this value is not a well-formed certificate; empty when it is."""
        out = []

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for f in ("checkpoint_fingerprint", "token_hash", "dtype", "producer_version"):
            if not isinstance(getattr(self, f), str):
                out.append(f"{f} is not a string")
        for f in ("n_tokens", "tp_size", "tp_rank", "generation"):
            if not is_int(getattr(self, f)):
                out.append(f"{f} is not an integer")
        if not isinstance(self.profile, dict):
            out.append("profile is not a map")
        cr = self.channel_range
        if not (isinstance(cr, tuple) and len(cr) == 2 and all(map(is_int, cr)) and 0 <= cr[0] <= cr[1]):
            out.append(f"channel_range {cr!r} is not (lo, hi) with 0 <= lo <= hi")
        if not (isinstance(self.layers, tuple) and all(map(is_int, self.layers))):
            out.append("layers is not a tuple of integers")
        sd = self.shard_digests
        if not (isinstance(sd, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in sd.items())):
            out.append("shard_digests is not a map of strings")
        if not out and not 0 <= self.tp_rank < self.tp_size:
            out.append(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        return out


# ---------------------------------------------------------------------------------------------------- verdicts

@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: FallbackReason | None = None
    detail: str = ""

    @staticmethod
    def accept() -> "Verdict":
        return Verdict(True, None, "")

    @staticmethod
    def reject(reason: FallbackReason, detail: str) -> "Verdict":
        assert isinstance(reason, FallbackReason), reason
        return Verdict(False, reason, detail)


def validate(cert, *, fingerprint: str, tokens_hash: str, profile: dict, tp_size: int, tp_rank: int,
             channel_range: tuple[int, int], layers_needed: set[int], current_generation: int,
             dtype: str, producer_version: str, shard_digests_seen: dict[str, str] | None = None) -> Verdict:
    """This rank's verdict on `cert`. Checks run in a fixed order so the reported reason is deterministic.
    Never raises on a bad certificate: a malformed one (or a non-certificate) is a reject."""
    R = FallbackReason
    if not isinstance(cert, Certificate):
        return Verdict.reject(R.MISSING_SHARD, f"no certificate: got {type(cert).__name__}")
    bad = cert.problems()
    if bad:
        # the certificate is the artifact's root shard; a malformed one means no usable artifact
        return Verdict.reject(R.MISSING_SHARD, "malformed certificate: " + "; ".join(bad))
    if cert.checkpoint_fingerprint != fingerprint:
        return Verdict.reject(R.CHECKPOINT_MISMATCH,
                              f"artifact built on checkpoint {cert.checkpoint_fingerprint[:16]}, serving {fingerprint[:16]}")
    if cert.token_hash != tokens_hash:
        return Verdict.reject(R.TOKEN_MISMATCH, f"token hash {cert.token_hash[:16]} != requested {tokens_hash[:16]}")
    want = _canon(profile.to_dict() if hasattr(profile, "to_dict") else profile)
    have = _canon(cert.profile)
    if have != want:
        keys = sorted(k for k in set(have) | set(want) if have.get(k, ...) != want.get(k, ...))
        return Verdict.reject(R.PROFILE_MISMATCH, "profile differs in " + ", ".join(
            f"{k}: {have.get(k, '<absent>')!r} vs {want.get(k, '<absent>')!r}" for k in keys))
    if (cert.dtype, cert.producer_version) != (dtype, producer_version):
        return Verdict.reject(R.PRODUCER_MISMATCH, f"artifact is {cert.dtype} from {cert.producer_version}, "
                                                   f"this server consumes {dtype} from {producer_version}")
    geometry = (cert.tp_size, cert.tp_rank, tuple(cert.channel_range))
    expected = (tp_size, tp_rank, tuple(channel_range))
    if geometry != expected:
        return Verdict.reject(R.TP_GEOMETRY_MISMATCH,
                              f"(size, rank, channels) certified {geometry}, this rank is {expected}")
    absent = sorted(set(layers_needed) - set(cert.layers))
    if absent:
        return Verdict.reject(R.MISSING_LAYER, f"layers {absent} not in artifact")
    if cert.generation != current_generation:
        return Verdict.reject(R.STALE_GENERATION,
                              f"artifact generation {cert.generation}, current is {current_generation}")
    if shard_digests_seen is not None:
        # sorted: the store reads shards in this same order and may stop at the first bad one
        for name in sorted(cert.shard_digests):
            seen = shard_digests_seen.get(name)
            if seen is None:
                return Verdict.reject(R.MISSING_SHARD, f"shard {name} not found")
            if seen != cert.shard_digests[name]:
                return Verdict.reject(R.DIGEST_MISMATCH,
                                      f"shard {name} digest {seen[:16]} != certified {cert.shard_digests[name][:16]}")
    return Verdict.accept()


def agree(verdict: Verdict, par: Parallel, *, binding: str | None = None) -> Verdict:
    """Every TP rank accepts or none does, decided by one all_gather_object of (ok, reason, binding).

    `binding` (optional, e.g. `cert.binding_digest()`) catches ranks that each accept different artifacts,
    say after seeing different current generations; when given it must be given on every rank."""
    if par.size == 1:
        return verdict
    gathered = par.all_gather_object((verdict.ok, verdict.reason.value if verdict.reason else None, binding))
    assert len(gathered) == par.size
    failing = [(r, reason) for r, (ok, reason, _) in enumerate(gathered) if not ok]
    if not failing:
        bindings = {b for _, _, b in gathered}
        if len(bindings) == 1:
            return Verdict.accept()
        return Verdict.reject(FallbackReason.RANK_DISAGREEMENT,
                              "ranks accepted different artifacts: " + ", ".join(
                                  f"rank {r}: {(b or '<none>')[:16]}" for r, (_, _, b) in enumerate(gathered)))
    if not verdict.ok:
        return verdict
    return Verdict.reject(FallbackReason.RANK_DISAGREEMENT,
                          "rejected by " + ", ".join(f"rank {r}: {reason}" for r, reason in failing))


# ---------------------------------------------------------------------------------------------------- metrics

class FallbackCounter:
    """Thread-safe fallback counts by reason; every reason is present (zero) so the label set is fixed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = {r: 0 for r in FallbackReason}

    def inc(self, reason: FallbackReason | str, n: int = 1) -> None:
        reason = FallbackReason(reason)      # ValueError on an unknown label keeps the label set bounded
        with self._lock:
            self._counts[reason] += n

    def observe(self, verdict: Verdict) -> None:
        if not verdict.ok:
            self.inc(verdict.reason)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {r.value: c for r, c in self._counts.items()}
