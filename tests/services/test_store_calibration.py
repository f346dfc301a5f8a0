"""Calibration records in the store (issue 31): an admin tenant puts a record, filed under the checkpoint and profile
it names itself; every tenant reads the same bytes back; a later put replaces it; only admin tenants write; records
live in the index (they survive a store restart); a corrupted index entry is never served."""
from __future__ import annotations

import json

import pytest
import redis

from services.store.calibration import CalibrationKey
from services.store.errors import DataLoss, NotFound, PermissionDenied
from services.store.keys import digest_bytes, profile_id

ADMIN = {"REDKNOT_STORE_ADMIN_TENANTS": "acme"}
FP = digest_bytes(b"checkpoint")
PROFILE = {"name": "demo", "budget": 0.25, "select": "mixed"}


def record(passed: bool = True, profile: dict = PROFILE, fingerprint: str = FP) -> bytes:
    return json.dumps({"version": 1, "fingerprint": fingerprint, "profile": profile, "passed": passed,
                       "metrics": {"tf_top1": {"value": 0.97, "ci": [0.95, 0.99]}}}).encode()


def key(profile: dict = PROFILE, fingerprint: str = FP) -> CalibrationKey:
    return CalibrationKey(fingerprint, profile_id(profile))


@pytest.fixture
def admin_store(store_factory):
    return store_factory(extra_env=ADMIN).start()


def test_an_admin_puts_a_record_under_its_own_key_and_every_tenant_reads_it(admin_store):
    with admin_store.client("acme") as acme, admin_store.client("globex") as globex:
        with pytest.raises(NotFound):
            globex.get_calibration(key())
        first = acme.put_calibration(record(passed=False))
        assert first.key == key() and not first.replaced and first.digest == digest_bytes(record(passed=False))
        got = globex.get_calibration(key())                     # not a tenant's: another tenant reads it
        assert got.record == record(passed=False) and got.stored_by == "acme" and got.digest == first.digest
        assert got.stored_at_unix_ms == first.stored_at_unix_ms > 0
        second = acme.put_calibration(record(passed=True))      # a new calibration of the same pair replaces it
        assert second.replaced and second.key == first.key
        assert json.loads(globex.get_calibration(key()).record)["passed"] is True
        other = dict(PROFILE, budget=0.1)                       # another profile is another record
        assert acme.put_calibration(record(profile=other)).key == key(other) != key()
        assert json.loads(acme.get_calibration(key()).record)["profile"] == PROFILE
        with pytest.raises(NotFound):
            acme.get_calibration(key(fingerprint=digest_bytes(b"another checkpoint")))


def test_only_the_stores_admin_tenants_write_records(store_factory):
    admin = store_factory(extra_env=ADMIN).start()
    with admin.client("globex") as globex:
        with pytest.raises(PermissionDenied, match="admin tenants"):
            globex.put_calibration(record())
        with pytest.raises(NotFound):
            globex.get_calibration(key())                       # nothing was stored
    admin.kill()
    closed = store_factory().start()                            # no --admin-tenants: no tenant writes
    with closed.client("acme") as acme, pytest.raises(PermissionDenied):
        acme.put_calibration(record())


def test_records_live_in_the_index_across_a_restart(store_factory):
    first = store_factory(extra_env=ADMIN).start()
    with first.client() as c:
        c.put_calibration(record())
    first.kill()
    second = store_factory().start()                            # same Redis prefix; no admin needed to read
    with second.client("globex") as c:
        assert c.get_calibration(key()).record == record()


def test_a_corrupted_index_entry_is_never_served(admin_store, redis_url):
    with admin_store.client() as c:
        c.put_calibration(record())
        r = redis.Redis.from_url(redis_url)
        (k,) = r.keys(f"{admin_store.prefix}:{{_deployment}}:calibration:*")
        r.hset(k, "record", record(passed=False))               # altered behind the store's back
        with pytest.raises(DataLoss, match="digest"):
            c.get_calibration(key())
        r.hdel(k, "digest")
        with pytest.raises(DataLoss, match="corrupt"):
            c.get_calibration(key())
