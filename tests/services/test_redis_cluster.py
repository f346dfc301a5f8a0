"""The index, the registry and the build queue on a real Redis Cluster (SPEC §8): three masters started here on free
loopback ports, the store process on a `redis+cluster://` URL. Every multi-key script or transaction names keys of
one hash tag (redis-py's cluster client and the server both refuse one that does not, so every flow here checks it
again); two documents' keys land on different slots of different masters, and each one's lifecycle, commit race and
GC hold as on one Redis. The store's own tests run here unchanged, on the cluster."""
from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from services.common.build_queue import BuildQueue
from services.common.registry import Registry
from services.store.errors import NotFound
from services.store.index import RedisIndex
from services.store.redis_client import sync_client

from . import test_builder_queue, test_store_lifecycle, test_store_race
from .conftest import StoreProcess, doc_key, fetch_all, free_port, make_generation

START_TIMEOUT_S = 30.0
MASTERS = 3
SLOTS = 16384


def _node(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, socket_timeout=5)


def _cluster_ok(ports: list[int]) -> bool:
    try:
        for p in ports:
            info = _node(p).execute_command("CLUSTER", "INFO").decode()
            if "cluster_state:ok" not in info or f"cluster_known_nodes:{len(ports)}" not in info:
                return False
        return True
    except redis.RedisError:
        return False


@pytest.fixture(scope="module")
def redis_cluster_url(tmp_path_factory):
    """Three masters, slots split evenly with CLUSTER ADDSLOTSRANGE, joined with CLUSTER MEET; SIGKILLed at the
    end. Skipped only when redis-server is not installed."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    d = tmp_path_factory.mktemp("redis-cluster")
    ports, procs = [], []
    try:
        for i in range(MASTERS):
            while (p := free_port()) in ports or p + 10000 > 65535:      # the cluster bus listens on port + 10000
                pass
            ports.append(p)
            procs.append(subprocess.Popen(
                [exe, "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-config-file",
                 str(d / f"nodes-{p}.conf"), "--appendonly", "no", "--save", "", "--dir", str(d)],
                stdout=open(d / f"redis-{p}.log", "wb"), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + START_TIMEOUT_S
        for p, proc in zip(ports, procs):
            while True:
                assert proc.poll() is None, (d / f"redis-{p}.log").read_text()[-2000:]
                try:
                    _node(p).ping()
                    break
                except redis.RedisError:
                    assert time.monotonic() < deadline, f"redis-server on {p} did not start"
                    time.sleep(0.05)
        for i, p in enumerate(ports):
            lo, hi = i * SLOTS // MASTERS, (i + 1) * SLOTS // MASTERS - 1
            _node(p).execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for p in ports[1:]:
            _node(p).execute_command("CLUSTER", "MEET", "127.0.0.1", ports[0])
        while not _cluster_ok(ports):
            assert time.monotonic() < deadline, "the cluster did not reach cluster_state:ok"
            time.sleep(0.1)
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def rc(redis_cluster_url):
    r = sync_client(redis_cluster_url)
    yield r
    r.close()


@pytest.fixture
def prefix():
    return f"rkc-{uuid.uuid4().hex[:10]}"       # the cluster lives for this module only: nothing to clean up


@pytest.fixture
def store(redis_cluster_url, prefix, tmp_path):
    s = StoreProcess(tmp_path, redis_cluster_url, prefix).start()
    yield s
    s.kill()


@pytest.fixture
def client(store):
    with store.client() as c:
        yield c


# ------------------------------------------------------------------------------------------ one slot per step

def _index_steps(ix: RedisIndex, tenant: str, doc_id: str) -> dict[str, list[str]]:
    """Every key list the index hands to one script (names as index.py builds them)."""
    k, up = ix.k, ix.k(tenant, doc_id, "up", "r")
    return {
        "begin": [k(tenant, doc_id, x) for x in ("doc", "gens", "retired")] + [up] +
                 [k(tenant, doc_id, x) for x in ("pins", "deleting", "uploads", "updigests")],
        "received": [up, up + ":recv", k(tenant, doc_id, "deleting")],
        "commit": [k(tenant, doc_id, x) for x in ("doc", "gens", "retired")] + [up, up + ":recv"] +
                  [k(tenant, doc_id, x) for x in ("gen:7", "refs", "deleting", "uploads", "updigests", "pins")],
        "retire": [k(tenant, doc_id, x) for x in ("doc", "gens", "retired", "gen:7", "refs")],
        "gc_mark": [k(tenant, doc_id, x) for x in ("refs", "pins", "deleting", "uploads", "updigests")],
        "read_manifest": [k(tenant, doc_id, x) for x in ("doc", "gens", "gen:7")],
        "listing hints": [ix.tk(tenant, "docs"), ix.tk(tenant, "byhash", "ab" * 32)],
    }


def test_every_script_and_transaction_names_keys_of_one_slot(rc, prefix):
    ix = RedisIndex(rc, prefix)
    for doc_id in ("0" * 32, "f" * 32):
        for step, keys in _index_steps(ix, "acme", doc_id).items():
            assert len({key_slot(k.encode()) for k in keys}) == 1, (step, keys)
    reg, q = Registry(rc, prefix), BuildQueue(rc, prefix)
    # the upload script (record, listing, stream) and the queue's transactions (stream, retry set, dead letters)
    keys = [reg._doc("acme", "a" * 32), reg._docs("acme"), reg._docs("globex"), q.stream, q.delayed, q.dead]
    assert len({key_slot(k.encode()) for k in keys}) == 1, keys
    with pytest.raises(RedisClusterException, match="same key slot"):      # what the cluster would refuse
        rc.eval("return 1", 2, ix.k("acme", "0" * 32, "doc"), ix.k("acme", "f" * 32, "doc"))


# ------------------------------------------------------------------------------------------------ the store

def _slot_and_node(rc, key: str) -> tuple[int, str]:
    slot = key_slot(key.encode())
    return slot, rc.nodes_manager.get_node_from_slot(slot).name


def test_two_documents_on_different_nodes_lifecycle_and_gc(rc, store, client):
    """Two documents whose keys live on different slots of different masters hold identical shard bytes (equal
    digests): each document's generations, retirement and GC act on its own slot only, and GC of one never touches
    the other's blobs."""
    ix = RedisIndex(rc, store.prefix)
    a = doc_key("cluster-a")
    where = lambda k: _slot_and_node(rc, ix.k("acme", k.doc_id, "doc"))     # noqa: E731
    b = next(k for k in (doc_key(f"cluster-b{i}") for i in range(64)) if where(k)[1] != where(a)[1])
    assert where(a)[0] != where(b)[0] and where(a)[1] != where(b)[1]
    ga1, ga2 = make_generation(a, tag="one"), make_generation(a, tag="two")
    gb1 = make_generation(b, tag="one")                         # the same bytes as a's generation 1
    assert {s.digest for s, _ in ga1} == {s.digest for s, _ in gb1}

    for key, gen in ((a, ga1), (b, gb1), (a, ga2)):
        bg = client.begin(key, [s for s, _ in gen])
        client.put(bg.upload_id, [(s, d) for s, d in gen if s.ref not in bg.already_stored])
        client.commit(bg.upload_id)
    m = client.manifest(a)
    assert (m.current_generation, m.generations) == (2, (1, 2))
    assert fetch_all(client, a, 0, generation=1) == {s.name: d for s, d in ga1 if s.rank == 0}  # older: readable
    assert fetch_all(client, b, 1) == {s.name: d for s, d in gb1 if s.rank == 1}
    assert {d.key for d in client.list_documents()} == {a, b}

    assert client.retire(a, 1) == 2
    gc = client.collect_garbage()
    only_a1 = {s.digest for s, _ in ga1} - {s.digest for s, _ in ga2}
    assert gc.blobs_deleted == len(only_a1) > 0
    assert fetch_all(client, b, 0) == {s.name: d for s, d in gb1 if s.rank == 0}       # b's copies untouched
    assert fetch_all(client, a, 1) == {s.name: d for s, d in ga2 if s.rank == 1}
    with pytest.raises(NotFound):
        client.manifest(a, generation=1)

    client.retire(a, 2)
    client.retire(b, 1)
    gc = client.collect_garbage()
    assert gc.blobs_deleted == len({s.digest for s, _ in ga2}) + len({s.digest for s, _ in gb1})
    assert not [p for p in Path(store.blob_root, "blobs").rglob("*") if p.is_file()]
    assert client.list_documents() == []


def test_lifecycle_on_the_cluster(store, client):
    test_store_lifecycle.test_older_generations_stay_readable_until_retired_and_gc_deletes_only_unreferenced(
        store, client)


def test_a_blob_claimed_by_gc_is_refused_on_the_cluster(store, client, redis_cluster_url):
    test_store_lifecycle.test_a_blob_claimed_by_gc_is_neither_deduplicated_nor_written_nor_committed(
        store, client, redis_cluster_url)


def test_concurrent_commits_on_the_cluster(store):
    test_store_race.test_eight_concurrent_committers(store)
    test_store_race.test_eight_producers_race_for_one_generation_number(store)


# --------------------------------------------------------------------------------------- registry and queue

def test_queue_redelivery_on_the_cluster(rc, prefix):
    test_builder_queue.test_queue_redelivers_a_crashed_job_and_counts_depth(rc, prefix)


def test_registry_and_queue_retry_dead_letter_and_rebuild_on_the_cluster(rc, prefix):
    reg, q = Registry(rc, prefix), BuildQueue(rc, prefix, claim_idle_ms=60_000)
    q.ensure_group()
    doc = "b" * 32
    rec, queued = reg.create("acme", doc, [1, 2, 3, 4], "tokens")
    assert queued and reg.tokens("acme", doc) == [1, 2, 3, 4] and reg.count("acme") == 1
    job = q.claim("builder-a", block_ms=10)
    assert reg.start_attempt("acme", doc) == 1 and reg.get("acme", doc).status == "building"
    reg.update("acme", doc, stage="producing", progress=0.5)
    assert reg.get("acme", doc).stage == "producing"
    q.retry(job, attempt=2, delay_s=0.0)                        # the retry set, then back into the stream
    assert q.depth() == 1 and q.promote_due() == 1
    job = q.claim("builder-a", block_ms=10)
    assert (job.tenant, job.doc) == ("acme", doc)
    q.dead_letter(job, attempts=2, error="boom")
    reg.update("acme", doc, status="failed", stage="failed", error="boom")
    assert q.depth() == 0 and [(d["doc"], d["error"]) for d in q.dead_letters()] == [(doc, "boom")]

    rec, queued = reg.create("acme", doc, [1, 2, 3, 4], "tokens")     # a failed document uploaded again is queued
    assert queued and rec.status == "queued" and rec.target_generation == 1
    job = q.claim("builder-b", block_ms=10)
    assert reg.mark_ready("acme", doc, 1, {"doc_hash": "x"}, 10, 2, 0.1)
    q.done(job)
    assert reg.get("acme", doc).generations == [1] and q.depth() == 0
    reg.mark_retired("acme", doc, 1)
    rec, queued = reg.create("acme", doc, [1, 2, 3, 4], "tokens")     # retired: rebuilt under a new generation
    assert queued and rec.target_generation == 2
    page, nxt = reg.page("acme", 0, 10)
    assert [r.id for r in page] == [doc] and nxt is None
