"""The worker's host-memory tier and prefetcher (a real store process on loopback) and how a fallback's root
cause is named across ranks."""
from __future__ import annotations

import pytest

from runtime.reuse.prefetch import SourceError
from services.common.tenants import Tenants
from services.worker.engine import RankReport, root_cause
from services.worker.prefetch import FetchStats, Prefetcher
from services.worker.tier import HostTier

from .conftest import TOKENS, doc_key, make_generation


def _dir(tmp_path, name: str, nbytes: int):
    d = tmp_path / "src" / name
    d.mkdir(parents=True)
    (d / "blob").write_bytes(b"x" * nbytes)
    return d


def test_host_tier_evicts_least_recently_used_never_a_pinned_entry(tmp_path):
    tier = HostTier(tmp_path / "tier", capacity_bytes=250)
    a, b, c = ("t", "a", 1), ("t", "b", 1), ("t", "c", 1)
    tier.insert(a, _dir(tmp_path, "a", 100), 100)
    tier.insert(b, _dir(tmp_path, "b", 100), 100)
    assert tier.lookup(a) is not None                 # a is now the most recent, and pinned
    tier.insert(c, _dir(tmp_path, "c", 100), 100)     # over capacity: b (least recent, unpinned) goes
    assert tier.keys() == [a, c] and tier.lookup(b) is None
    assert tier.take_counts() == (1, 1)
    tier.insert(("t", "d", 1), _dir(tmp_path, "d", 200), 200)
    assert tier.keys() == [a, ("t", "d", 1)]           # c goes; a is pinned, d the newest: kept over capacity
    tier.release(a)
    assert tier.keys() == [("t", "d", 1)] and tier.used == 200
    old = tier.older("t", "d")
    assert old is not None and old[0] == ("t", "d", 1)
    tier.drop(("t", "d", 1))
    assert not old[1].exists()


def test_prefetcher_fetches_only_its_rank_and_channel_range(tmp_path, store, client):
    key = doc_key("tier", tp_size=2)
    gen = make_generation(key, layers=3, channels=64)
    client.put_generation(key, gen, 1)
    tier = HostTier(tmp_path / "tier", 1 << 30)
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
        opened.published.result()
        want = {s.name: data for s, data in gen if s.rank == 1}
        streamed = {**head, **{n: d for _, files in got_groups for n, d in files.items()}}
        assert streamed == want                            # every shard of rank 1, none of rank 0
        assert all(".r0." not in n for n in streamed)
        path = tier.lookup(("acme", key.doc_id, 1))
        assert {p.name: p.read_bytes() for p in path.iterdir()} == want       # published whole into the tier
        tier.release(("acme", key.doc_id, 1))
        stats = pf.take_stats()
        assert stats.bytes == sum(len(d) for d in want.values()) and len(stats.seconds) == 1   # fetched once
        hit = pf.open("acme", key, 1)                      # a tier hit: the same bytes, group by group
        assert hit.pinned == ("acme", key.doc_id, 1) and hit.published is None
        assert [f.result() for _, f in hit.source.groups] == [files for _, files in got_groups]
        tier.release(hit.pinned)
        assert pf.take_stats() == FetchStats()
        missing = pf.open("acme", key, 2)
        with pytest.raises(SourceError) as e:
            missing.source.head.result()
        assert e.value.reason.value == "missing_shard"
        assert missing.published.result() is None and tier.lookup(("acme", key.doc_id, 2)) is None
    finally:
        pf.close()


def test_root_cause_names_the_rank_that_rejected_on_its_own():
    f = FetchStats()
    reports = [RankReport(0, "rank_disagreement", "rejected by rank 1", f, 0, 0),
               RankReport(1, "digest_mismatch", "shard layer02.local altered", f, 0, 0)]
    assert root_cause(reports) == ("digest_mismatch", "rank 1: shard layer02.local altered")
    both = [RankReport(0, "rank_disagreement", "bindings differ", f, 0, 0),
            RankReport(1, "rank_disagreement", "bindings differ", f, 0, 0)]
    assert root_cause(both)[0] == "rank_disagreement"
