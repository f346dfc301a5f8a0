"""Calibration records in the store (issue 31): the one deployment-wide state the store keeps.

A record (`redknot calibrate`: the quality harness's verdict on one checkpoint and profile) is stored under the
checkpoint fingerprint and the profile id it names itself (`keys.profile_id` of its profile, as documents are
keyed), so a record can never be filed under a pair it does not certify. Records are not a tenant's: every tenant
reads them (workers read with any tenant's token; the API shows them to every tenant), and only the tenants named
by the store's `--admin-tenants` write them (PermissionDenied for the others). The store checks what keys the
record and its size, never its verdict: the workers judge it (`runtime.eval.calibrate.check_record`).

Index layout (prefix P): `P:{_deployment}:calibration:<fingerprint>:<profile id>`, a hash of `record` (the bytes
as put), `digest` (blake3 of them, checked on every read), `at` (Unix ms, the index server's clock) and `by` (the
admin tenant). The hash tag `{_deployment}` cannot be a tenant's (tenant names start with a letter or a digit),
so no tenant key can collide with it. One put is one script: the record replaces the old one whole."""
from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from .errors import DataLoss, InvalidArgument, LimitExceeded, NotFound, PermissionDenied
from .keys import check_digest, check_name, check_tenant, digest_bytes, profile_id

MAX_RECORD_BYTES = 64 << 10             # a record is a few KiB; the bound keeps a put cheap for the index
DEPLOYMENT_TAG = "{_deployment}"

_PUT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local existed = redis.call('EXISTS', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'record', ARGV[1], 'digest', ARGV[2], 'by', ARGV[3], 'at', now)
return {existed, now}
"""
# KEYS: the record's hash; ARGV: record bytes, their digest, the admin tenant


@dataclass(frozen=True)
class CalibrationKey:
    checkpoint_fingerprint: str
    profile: str                        # keys.profile_id of the record's profile

    def check(self) -> "CalibrationKey":
        check_digest("checkpoint_fingerprint", self.checkpoint_fingerprint)
        check_name("profile", self.profile)
        return self


@dataclass(frozen=True)
class StoredCalibration:
    """What PutCalibration did."""
    key: CalibrationKey
    digest: str
    stored_at_unix_ms: int
    replaced: bool


@dataclass(frozen=True)
class CalibrationEntry:
    """A stored record and where it came from."""
    record: bytes
    digest: str
    stored_at_unix_ms: int
    stored_by: str


def record_key(raw: bytes) -> CalibrationKey:
    """The key a record names (its fingerprint and its profile's id); InvalidArgument or LimitExceeded for bytes
    that are not a record the store can file."""
    if len(raw) > MAX_RECORD_BYTES:
        raise LimitExceeded(f"calibration record of {len(raw)} bytes: at most {MAX_RECORD_BYTES} are accepted")
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidArgument(f"the calibration record is not UTF-8 JSON: {e}") from None
    if not isinstance(record, dict):
        raise InvalidArgument(f"the calibration record is a JSON {type(record).__name__}, not an object")
    if "fingerprint" not in record:
        raise InvalidArgument("the calibration record has no fingerprint (the checkpoint it calibrates)")
    if not isinstance(record.get("profile"), dict):
        raise InvalidArgument("the calibration record has no profile object (the profile it calibrates)")
    fingerprint = check_digest("the calibration record's fingerprint", record["fingerprint"])
    return CalibrationKey(fingerprint, profile_id(record["profile"])).check()


class CalibrationRecords:
    """Put and get calibration records on the store's index (the same Redis and prefix as the documents')."""

    def __init__(self, client: aioredis.Redis, prefix: str, admins: frozenset[str] = frozenset()):
        self.r, self.prefix, self.admins = client, prefix, frozenset(check_tenant(a) for a in admins)
        self._put = client.register_script(_PUT)

    def k(self, key: CalibrationKey) -> str:
        return f"{self.prefix}:{DEPLOYMENT_TAG}:calibration:{key.checkpoint_fingerprint}:{key.profile}"

    async def put(self, tenant: str, raw: bytes) -> StoredCalibration:
        if tenant not in self.admins:
            raise PermissionDenied(f"tenant {tenant!r} may not store calibration records: they are deployment-wide, "
                                   f"written only by the store's admin tenants (--admin-tenants)")
        key = record_key(raw)
        digest = digest_bytes(raw)
        existed, now = await self._put(keys=[self.k(key)], args=[raw, digest, tenant])
        return StoredCalibration(key, digest, int(now), bool(existed))

    async def get(self, key: CalibrationKey) -> CalibrationEntry:
        h = await self.r.hgetall(self.k(key.check()))
        if not h:
            raise NotFound(f"no calibration record for checkpoint {key.checkpoint_fingerprint[:12]}... and profile "
                           f"{key.profile}")
        try:
            entry = CalibrationEntry(h[b"record"], h[b"digest"].decode(), int(h[b"at"]), h[b"by"].decode())
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            raise DataLoss(f"the index's calibration record entry is corrupt ({type(e).__name__}: {e})") from None
        if digest_bytes(entry.record) != entry.digest:
            raise DataLoss("the stored calibration record does not match its digest")
        return entry
