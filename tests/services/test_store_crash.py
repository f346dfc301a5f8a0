"""SIGKILL the store mid-upload and mid-commit, restart it on the same Redis and blob root: no partial
generation is visible, the previous generation is still served bit for bit, nothing committed is lost."""
from __future__ import annotations

import threading
import time

import pytest

from services.store.errors import FailedPrecondition, StoreError

from .conftest import doc_key, fetch_all, make_generation


def served(client, key) -> dict:
    return {rank: fetch_all(client, key, rank) for rank in range(key.tp_size)}


def expected(gen) -> dict:
    out: dict = {}
    for s, d in gen:
        out.setdefault(s.rank, {})[s.name] = d
    return out


def run_in_thread(fn):
    box = {}

    def target():
        try:
            box["value"] = fn()
        except StoreError as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def test_sigkill_mid_upload(store_factory):
    key = doc_key("crash-upload")
    g1, g2 = make_generation(key, tag="one", size=6 << 20), make_generation(key, tag="two", size=6 << 20)
    store = store_factory(extra_env={"REDKNOT_STORE_SPOOL_STALE_S": "0"}).start()
    with store.client() as c:
        c.put_generation(key, g1)
        b = c.begin(key, [s for s, _ in g2])
        release = threading.Event()
        big = next((s, d) for s, d in g2 if s.size == 6 << 20)

        def chunks():                    # the first 4 MiB of a 6 MiB shard, then wait for the kill
            from services.store.pb import artifact_store_pb2 as pb
            yield pb.PutShardsRequest(upload_id=b.upload_id, rank=big[0].rank, name=big[0].name, offset=0,
                                      data=big[1][:4 << 20])
            release.wait(30)
            yield pb.PutShardsRequest(upload_id=b.upload_id, rank=big[0].rank, name=big[0].name, offset=4 << 20,
                                      data=big[1][4 << 20:], last=True)

        t, box = run_in_thread(lambda: c._call(c.stub.PutShards, chunks()))
        spool = store.blob_root / "spool"
        deadline = time.monotonic() + 20
        while not any(p.stat().st_size > 0 for p in spool.glob("*.part")):
            assert time.monotonic() < deadline, "the store never started writing the shard"
            time.sleep(0.02)
        store.kill()
        release.set()
        t.join(20)
        assert "error" in box

    store = store_factory(extra_env={"REDKNOT_STORE_SPOOL_STALE_S": "0"}).start()
    with store.client() as c:
        m = c.manifest(key)
        assert (m.current_generation, m.generations) == (1, (1,))
        assert served(c, key) == expected(g1)
        with pytest.raises(FailedPrecondition):          # the half-sent shard was never recorded
            c.commit(b.upload_id)
        assert c.manifest(key).generations == (1,)
        gc = c.collect_garbage(key)
        assert gc.temp_files_removed >= 1 and not list((store.blob_root / "spool").iterdir())
        assert served(c, key) == expected(g1)
        # the producer finishes the same upload after the restart
        c.put(b.upload_id, g2)
        assert c.commit(b.upload_id).current_generation == 2
        assert served(c, key) == expected(g2)
        assert fetch_all(c, key, 0, generation=1) == expected(g1)[0]


@pytest.mark.parametrize("point", ["commit.before_script", "commit.after_script"])
def test_sigkill_mid_commit(store_factory, point):
    key = doc_key(f"crash-{point}")
    g1, g2 = make_generation(key, tag="one"), make_generation(key, tag="two")
    store = store_factory().start()
    with store.client() as c:
        c.put_generation(key, g1)
    store.kill()

    store = store_factory(extra_env={"REDKNOT_STORE_FAILPOINTS": point}).start()
    with store.client() as c:
        b = c.begin(key, [s for s, _ in g2])
        c.put(b.upload_id, g2)
        t, box = run_in_thread(lambda: c.commit(b.upload_id))
        store.wait_log(f"FAILPOINT {point} reached")
        store.kill()
        t.join(20)
        assert "error" in box                         # the producer never heard back

    store = store_factory().start()
    with store.client() as c:
        m = c.manifest(key)
        if point == "commit.before_script":
            # killed before the atomic step: generation 2 is invisible, 1 is served; the upload can still commit
            assert (m.current_generation, m.generations) == (1, (1,))
            assert served(c, key) == expected(g1)
            assert c.commit(b.upload_id).current_generation == 2
        else:
            # killed after it: the commit happened and survives the crash whole
            assert (m.current_generation, m.generations) == (2, (1, 2))
        assert served(c, key) == expected(g2)
        assert fetch_all(c, key, 1, generation=1) == expected(g1)[1]
