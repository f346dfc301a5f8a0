"""The worker's pinned host tier and prefetcher (a real store process on loopback) and how a fallback's root
cause is named across ranks."""
from __future__ import annotations

import pytest
import torch

from runtime.reuse.artifact import DocumentArtifact, LayerArtifact
from runtime.reuse.stager import SourceError, Trace
from runtime.reuse.store import ArtifactHead
from services.common.tenants import Tenants
from services.worker.engine import RankReport, root_cause
from services.worker.prefetch import FetchStats, Prefetcher
from services.worker.tier import PinnedTier, TierCounts, host_bytes

from .conftest import TOKENS, doc_key, make_generation


def _doc(nbytes: int) -> DocumentArtifact:
    """A document whose one layer holds `nbytes` bytes (what the tier counts)."""
    return DocumentArtifact([1], 1, [LayerArtifact(latent=torch.zeros(nbytes, dtype=torch.uint8))])


HEAD = ArtifactHead(certificate=None, manifest={})      # the tier keeps a head; it never reads it


def test_pinned_tier_evicts_least_recently_used_by_bytes_never_a_pinned_entry_and_names_each_miss():
    tier = PinnedTier(capacity_bytes=250)
    a, b, c, d = ("t", "a", 1), ("t", "b", 1), ("t", "c", 1), ("t", "d", 1)
    tier.insert(a, HEAD, _doc(100))
    tier.insert(b, HEAD, _doc(100))
    assert tier.used == 200
    assert tier.lookup(a).nbytes == 100               # a is now the most recent, and pinned
    tier.insert(c, HEAD, _doc(100))                   # over capacity: b (least recent, unpinned) goes
    assert tier.keys() == [a, c] and tier.lookup(b) is None and tier.lookup(("t", "x", 1)) is None
    counts = tier.take_counts()
    assert (counts.hits, counts.misses, counts.evictions) == (1, {"absent": 1, "evicted": 1, "dropped": 0}, 1)
    tier.insert(d, HEAD, _doc(200))
    assert tier.keys() == [a, d]                      # c goes; a is pinned, d the newest: kept over capacity
    tier.release(a)
    assert tier.keys() == [d] and tier.used == 200
    old = tier.older("t", "d")
    assert old is not None and old[0] == d and old[1].nbytes == 200
    tier.drop(d)
    assert tier.keys() == [] and tier.used == 0 and tier.lookup(d) is None
    counts = tier.take_counts()
    assert counts.misses == {"absent": 0, "evicted": 0, "dropped": 1} and counts.evictions == 2
    entry = tier.insert(a, HEAD, _doc(10))
    assert tier.insert(a, HEAD, _doc(99)) is entry    # an existing entry wins
    with pytest.raises(ValueError):
        PinnedTier(-1)


def test_host_bytes_counts_each_storage_once():
    slab = torch.zeros(1000, dtype=torch.uint8)
    doc = DocumentArtifact([1], 1, [LayerArtifact(latent=slab[:400]), LayerArtifact(latent=slab[400:])])
    assert host_bytes(doc) == 1000


def test_prefetcher_fetches_only_its_rank_and_channel_range(tmp_path, store, client):
    key = doc_key("tier", tp_size=2)
    gen = make_generation(key, layers=3, channels=64)
    client.put_generation(key, gen, 1)
    tier = PinnedTier(1 << 30)
    pf = Prefetcher(tier, Tenants(TOKENS), store.target, rank=1, channels=(64, 128), n_layers=3, layer_group=2,
                    threads=2)
    try:
        pf.warm([("acme", key, 1)])
        opened = pf.open("acme", key, 1)                   # joins the warm-up's fetch: one fetch, not two
        assert opened.pinned is None
        got_groups = [(r, f.result()) for r, f in opened.source.groups]
        assert [r for r, _ in got_groups] == [range(0, 2), range(2, 3)]
        head = opened.source.head.result()
        assert set(head) == {"certificate.msgpack", "manifest.msgpack"}
        want = {s.name: data for s, data in gen if s.rank == 1}
        streamed = {**head, **{n: d for _, files in got_groups for n, d in files.items()}}
        assert streamed == want                            # every shard of rank 1, none of rank 0
        assert all(".r0." not in n for n in streamed)
        # these bytes are no artifact (no certificate parses): verified before the tier, and not kept
        assert opened.published.result() is None and tier.keys() == []
        stats = pf.take_stats()
        assert stats.bytes == sum(len(d) for d in want.values()) and len(stats.seconds) == 1   # fetched once
        missing = pf.open("acme", key, 2)
        with pytest.raises(SourceError) as e:
            missing.source.head.result()
        assert e.value.reason.value == "missing_shard"
        assert missing.published.result() is None and tier.lookup(("acme", key.doc_id, 2)) is None
    finally:
        pf.close()


def test_root_cause_names_the_rank_that_rejected_on_its_own():
    f = FetchStats()
    t = TierCounts()
    reports = [RankReport(0, "rank_disagreement", "rejected by rank 1", f, t, 0),
               RankReport(1, "digest_mismatch", "shard layer02.local altered", f, t, 0, document=3)]
    assert root_cause(reports) == ("digest_mismatch", "rank 1: shard layer02.local altered", 3)
    both = [RankReport(0, "rank_disagreement", "bindings differ", f, t, 0),
            RankReport(1, "rank_disagreement", "bindings differ", f, t, 0)]
    assert root_cause(both)[0] == "rank_disagreement"


def test_open_all_fetches_every_head_then_group_by_group_across_documents(store, client):
    """One fetch stream: the store is asked for every document's head first, then group 0 of every document,
    then group 1, ... (document by document, the forward's first group of the last document came with the last
    bytes, and the forward waited for nearly the whole fetch)."""
    keys = [doc_key(f"order{i}", tp_size=2) for i in range(3)]
    for k in keys:
        client.put_generation(k, make_generation(k, layers=5, channels=64), 1)
    trace = Trace()
    pf = Prefetcher(PinnedTier(0), Tenants(TOKENS), store.target, rank=0, channels=(0, 64), n_layers=5,
                    layer_group=2, threads=1, trace=trace)
    try:
        opened = pf.open_all([("acme", k, 1) for k in keys])
        assert [o.pinned for o in opened] == [None] * 3
        for o in opened:
            [f.result() for _, f in o.source.groups]
        starts = [g for e, g in trace.events if e == "fetch_start"]
        assert starts == [-1] * 3 + [0] * 3 + [1] * 3 + [2] * 3
        # a document named twice is fetched once; one already in flight is joined
        again = pf.open_all([("acme", keys[0], 1), ("acme", keys[0], 1)])
        assert again[0].source is again[1].source
    finally:
        pf.close()
