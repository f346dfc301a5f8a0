"""Flip one byte of a stored blob (filesystem and S3): reading it fails with DATA_LOSS, the digest-failure
counter moves, nothing corrupt is returned, and uploading the same bytes again repairs it."""
from __future__ import annotations

import pytest

from services.store.errors import DataLoss
from services.store.keys import Reason, ShardKind

from .conftest import doc_key, fetch_all, make_generation

READ_FAILURES = ("redknot_store_digest_failures_total", 'stage="read"')


def _victim(gen, rank=0):
    return next((s, d) for s, d in gen if s.rank == rank and s.kind is ShardKind.LATENT)


def _check_corruption(store, client, key, gen, corrupt, restore_check=True):
    spec, data = _victim(gen)
    before = store.metric(*READ_FAILURES)
    corrupt(spec, data)
    with pytest.raises(DataLoss):
        list(client.fetch(key, 0))
    with pytest.raises(DataLoss):
        client.fetch_rank(key, 0, store.tmp / "never-written")
    assert not (store.tmp / "never-written").exists()
    assert store.metric(*READ_FAILURES) == before + 2
    others = [s.name for s, _ in gen if s.rank == 0 and s.name != spec.name]
    assert {s.spec.name for s in client.fetch(key, 0, names=others)} == set(others)   # the rest still serves
    v = client.validate(key, 0, deep=True)
    assert not v.ok and v.reason is Reason.DIGEST_MISMATCH
    # uploading the same content again replaces the rotten blob (Begin re-hashes before deduplicating)
    res = client.put_generation(key, gen)
    assert fetch_all(client, key, 0) == {s.name: d for s, d in gen if s.rank == 0}
    assert fetch_all(client, key, 0, generation=res.manifest.generation - 1)[spec.name] == data


def test_flipped_byte_on_the_filesystem(store, client):
    key = doc_key("corrupt-fs")
    gen = make_generation(key, size=100_000)
    client.put_generation(key, gen)

    def corrupt(spec, data):
        path = next((store.blob_root / "blobs").rglob(spec.digest))
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))

    _check_corruption(store, client, key, gen, corrupt)


def test_truncated_and_missing_blobs(store, client):
    key = doc_key("truncate-fs")
    gen = make_generation(key, size=100_000)
    client.put_generation(key, gen)
    spec, _ = _victim(gen)
    path = next((store.blob_root / "blobs").rglob(spec.digest))
    path.write_bytes(path.read_bytes()[:-1])
    assert client.validate(key, 0).reason is Reason.DIGEST_MISMATCH        # a size check catches truncation
    with pytest.raises(DataLoss):
        list(client.fetch(key, 0, names=[spec.name]))
    path.unlink()
    assert client.validate(key, 0).reason is Reason.MISSING_SHARD
    with pytest.raises(DataLoss):
        list(client.fetch(key, 0, names=[spec.name]))


def test_flipped_byte_in_s3(store_factory, seaweed):
    store = store_factory(backend="s3", extra_env={"REDKNOT_STORE_S3_ENDPOINT": seaweed["endpoint"],
                                                   "REDKNOT_STORE_S3_BUCKET": seaweed["bucket"],
                                                   "REDKNOT_STORE_S3_PREFIX": "corrupt/",
                                                   "AWS_ACCESS_KEY_ID": "any", "AWS_SECRET_ACCESS_KEY": "any"}).start()
    key = doc_key("corrupt-s3")
    gen = make_generation(key, size=100_000)
    s3 = seaweed["client"]
    with store.client() as client:
        client.put_generation(key, gen)

        def corrupt(spec, data):
            obj = next(o["Key"] for o in s3.list_objects_v2(Bucket=seaweed["bucket"], Prefix="corrupt/")["Contents"]
                       if o["Key"].endswith(spec.digest))
            raw = bytearray(s3.get_object(Bucket=seaweed["bucket"], Key=obj)["Body"].read())
            raw[7] ^= 0x80
            s3.put_object(Bucket=seaweed["bucket"], Key=obj, Body=bytes(raw))

        _check_corruption(store, client, key, gen, corrupt)
