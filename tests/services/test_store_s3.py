"""The S3 backend against a real SeaweedFS server: round trip, deduplication, retire + GC deleting objects,
and two store replicas over one Redis and one bucket serving each other's commits."""
from __future__ import annotations

from services.store.keys import ShardKind

from .conftest import doc_key, fetch_all, make_generation



def s3_store(store_factory, seaweed, **kw):
    return store_factory(backend="s3", extra_env={"REDKNOT_STORE_S3_ENDPOINT": seaweed["endpoint"],
                                                  "REDKNOT_STORE_S3_BUCKET": seaweed["bucket"], "REDKNOT_STORE_S3_PREFIX": "t/",
                                                  "AWS_ACCESS_KEY_ID": "any", "AWS_SECRET_ACCESS_KEY": "any"}, **kw)


def objects(seaweed, doc_id: str) -> set[str]:
    pages = seaweed["client"].get_paginator("list_objects_v2").paginate(Bucket=seaweed["bucket"], Prefix=f"t/acme/{doc_id}/")
    return {o["Key"].rsplit("/", 1)[-1] for p in pages for o in p.get("Contents", [])}


def test_s3_round_trip_gc_and_two_replicas(store_factory, seaweed):
    a = s3_store(store_factory, seaweed).start()
    b = s3_store(store_factory, seaweed).start()          # a second stateless replica
    key = doc_key("s3")
    g1 = make_generation(key, tag="one", size=5 << 20)     # several chunks per shard
    g2 = make_generation(key, tag="two", size=5 << 20)
    with a.client() as ca, b.client() as cb:
        ca.put_generation(key, g1)
        assert objects(seaweed, key.doc_id) == {s.digest for s, _ in g1}
        assert fetch_all(cb, key, 1) == {s.name: d for s, d in g1 if s.rank == 1}
        cb.put_generation(key, g2)
        assert ca.manifest(key).generations == (1, 2)
        assert fetch_all(ca, key, 0) == {s.name: d for s, d in g2 if s.rank == 0}
        # re-declaring generation 2's content uploads nothing
        begin = ca.begin(key, [s for s, _ in g2])
        assert len(begin.already_stored) == len(g2)
        ca.commit(begin.upload_id)
        ca.retire(key, 1)
        gc = cb.collect_garbage(key)
        assert gc.blobs_deleted == len({s.digest for s, _ in g1} - {s.digest for s, _ in g2})
        assert objects(seaweed, key.doc_id) == {s.digest for s, _ in g2}
        assert {s.spec.kind for s in ca.fetch(key, 0)} == set(ShardKind) - {ShardKind.OTHER}
