"""The standing fault suite: on the real local stack (its own redis-server with its AOF, the store, the API, the
builder and a worker, each a process on loopback), SIGKILL the store, the builder and redis-server at known phases
of a document build and of a generate request, start the killed process again, and hold the invariants:
- no acknowledged document is lost (every upload that got 200/202 is listed and readable afterwards);
- every build ends ready, or failed with a reason, within a bounded wait;
- after recovery, generate answers 200, in the reuse arm or with a fallback the worker counted; never a 5xx.
While a dependency is down, the API answers a clear 503 (Retry-After), never a hang.
A phase that timing cannot hit is held by a failpoint (services/common/failpoints.py; the store's stop for good),
then killed. Each test records its row with `record_property` ("fault": phase and process killed, then
"fault_outcome"); the root conftest prints the rows as a table at the end of the run, with or without -s or
xdist. Tests run in file order and share one stack: each leaves every service running."""
from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest
import redis

from services.common.build_queue import stream_key
from services.common.stack import LocalStack, StackConfig
from services.store.client import StoreClient

from .conftest import write_tiny_checkpoint
from .test_api_service import (PROFILE, QUESTION, TENANTS, api, binding, corrupt_local_shard, doc_tokens,
                               fallbacks, scrape, wait_status)

WAIT_S = 60.0                   # longest wait for a build, a log line or a restart
PAUSE_S = 1.0                   # the worker's before_fetch pause: long enough to kill something behind it
TEXTS = [f"Fault drill document {n}: the lighthouse keeper logs the ships that pass the northern cape. " * 2
         for n in ("one", "two", "three", "four", "five", "six")]


# ------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, checkpoint):
    """A stack with its own redis-server (so killing it harms no other test), TP 2 as the other service tests. The
    builder starts held at `producing` (the first test kills it there); the worker pauses PAUSE_S before each
    reuse fetch."""
    cfg = StackConfig(workdir=tmp_path_factory.mktemp("faults"), model=checkpoint, tp=2, profile=PROFILE,
                      prefix=f"rkfault-{uuid.uuid4().hex[:8]}", tenants=TENANTS,
                      builder_env={"REDKNOT_BUILDER_BACKOFF_S": "0.2", "REDKNOT_BUILDER_CLAIM_IDLE_S": "5",
                                   "REDKNOT_BUILDER_FAILPOINTS": "producing=3600"},
                      worker_env={"REDKNOT_WORKER_FAILPOINTS": f"before_fetch={PAUSE_S}"})
    st = LocalStack(cfg).start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def acknowledged() -> dict[str, str]:
    """id -> text of every upload the API acknowledged (200 or 202) in this module."""
    return {}


def upload(c: httpx.Client, acknowledged: dict, text: str, want: int = 202) -> dict:
    r = c.post("/v1/documents", json={"text": text})
    assert r.status_code == want, r.text
    acknowledged[r.json()["id"]] = text
    return r.json()


def wait_log(svc, text: str, count: int = 1, timeout: float = WAIT_S) -> None:
    """Until `text` is in this run of the service's log `count` times."""
    deadline = time.monotonic() + timeout
    while svc.log(1_000_000).count(text) < count:
        assert svc.alive(), f"{svc.name} exited:\n{svc.log()}"
        assert time.monotonic() < deadline, f"{text!r} x{count} not in the {svc.name} log after {timeout}s"
        time.sleep(0.05)


def restart_killed(stack, name: str, **env: str) -> None:
    """Start a service that was SIGKILLed, under `env` added to its own."""
    svc = stack.services[name]
    assert not svc.alive(), name
    svc.env = {**svc.env, **env}
    svc.start(stack.workdir)
    svc.wait_ready(WAIT_S)


def in_thread(fn):
    """Run `fn` on a thread; after join, box["value"] is its result or box["error"] what it raised."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except Exception as e:      # noqa: BLE001 - shown by the test that reads the box
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def post_generate(stack, ids: list[str]) -> httpx.Response:
    with api(stack) as c:
        return c.post("/v1/generate", json={"documents": ids, "question": QUESTION, "max_new_tokens": 2,
                                            "arm": "reuse"})


def generate_killing(stack, ids: list[str], name: str) -> httpx.Response:
    """A generate request held at the worker's before_fetch pause while service `name` is SIGKILLed; its response."""
    worker = stack.services["worker"]
    paused = worker.log(1_000_000).count("FAILPOINT before_fetch reached")
    t, box = in_thread(lambda: post_generate(stack, ids))
    wait_log(worker, "FAILPOINT before_fetch reached", paused + 1)
    stack.services[name].kill()
    t.join(WAIT_S)
    assert "value" in box, box
    return box["value"]


def served(stack, ids: list[str]) -> str:
    """After recovery: generate answers 200, by reuse or with a fallback the worker counted. The outcome in words."""
    before = fallbacks(stack)
    r = post_generate(stack, ids)
    assert r.status_code == 200, r.text
    out = r.json()
    counted = sum(fallbacks(stack).values()) - sum(before.values())
    if out["fallback"] is None:
        assert out["arm"] == "reuse" and counted == 0, out
        return "reuse"
    assert out["arm"] == "recompute" and counted == 1, (out, counted)
    return f"counted fallback {out['fallback']['reason']}"


def registry_state(stack) -> dict:
    r = redis.Redis.from_url(stack.redis_url)
    docs = {k: r.hgetall(k) for k in r.scan_iter(match=f"{stack.cfg.prefix}:*:doc:*", count=1000)}
    stream = stream_key(stack.cfg.prefix)
    return {"docs": docs, "entries": [e for e, _ in r.xrange(stream)]}


# ------------------------------------------------------------------------------------------------- builds

def test_build_queued_redis_killed(stack, acknowledged, record_property):
    """A build held at `producing` (every rank computed, nothing uploaded) and a second one queued behind it:
    SIGKILL redis-server. While it is down the API answers 503; it comes back with every record and queue entry
    as they were (its AOF is fsynced per write)."""
    record_property("fault", ("build queued behind another", "redis-server"))
    builder, rs = stack.services["builder"], stack.services["redis"]
    with api(stack) as c:
        upload(c, acknowledged, TEXTS[0])
        wait_log(builder, "FAILPOINT producing reached")
        b = upload(c, acknowledged, TEXTS[1])["id"]
        assert c.get(f"/v1/documents/{b}").json()["status"] == "queued"
        before = registry_state(stack)
        rs.kill()
        down = c.get(f"/v1/documents/{b}")
        assert down.status_code == 503 and "Redis" in down.json()["detail"] and down.headers["Retry-After"]
        restart_killed(stack, "redis")
        assert registry_state(stack) == before                  # nothing acknowledged was lost
        assert c.get(f"/v1/documents/{b}").json()["status"] == "queued"
    record_property("fault_outcome", "503 while down; every record and queue entry kept")


def test_build_producing_builder_killed(stack, acknowledged, record_property):
    """The builder, still held at `producing` on the first document: SIGKILL it. The restarted builder resumes its
    own pending job (attempt 2), then builds the queued one."""
    record_property("fault", ("build producing (nothing uploaded)", "builder"))
    a, b = list(acknowledged)[:2]
    with api(stack) as c:
        stack.services["builder"].kill()
        d = c.get(f"/v1/documents/{a}").json()
        assert d["status"] == "building" and d["generation"] == 0
        restart_killed(stack, "builder", REDKNOT_BUILDER_FAILPOINTS="")
        da, db = (wait_status(c, i, {"ready", "failed"}, timeout=WAIT_S) for i in (a, b))
    assert da["status"] == db["status"] == "ready", (da, db)
    assert da["attempts"] == 2 and db["attempts"] == 1 and da["generation"] == db["generation"] == 1
    outcome = served(stack, [a, b])
    assert outcome == "reuse"
    record_property("fault_outcome", f"ready after 2 attempts, the queued one after 1; generate: {outcome}")


def test_build_uploading_store_killed(stack, acknowledged, record_property):
    """The store held after storing one shard of an upload, its stream still open: SIGKILL it. No generation of
    the document is readable; the builder's attempt fails and is retried against the restarted store."""
    record_property("fault", ("build uploading (1 shard stored)", "store"))
    stack.restart("store", env={"REDKNOT_STORE_FAILPOINTS": "put.after_shard"})
    store = stack.services["store"]
    key = binding(stack.cfg.model).store_key(doc_tokens(stack.cfg.model, TEXTS[2]))
    with api(stack) as c:
        doc = upload(c, acknowledged, TEXTS[2])["id"]
        wait_log(store, "FAILPOINT put.after_shard reached")
        assert c.get(f"/v1/documents/{doc}").json()["stage"] == "uploading"
        store.kill()
        restart_killed(stack, "store", REDKNOT_STORE_FAILPOINTS="")
        d = wait_status(c, doc, {"ready", "failed"}, timeout=WAIT_S)
    assert d["status"] == "ready" and d["generation"] == 1 and d["attempts"] >= 2, d
    with StoreClient(stack.store_target, TENANTS["acme"]) as client:
        assert client.manifest(key).current_generation == 1
    outcome = served(stack, [doc])
    assert outcome == "reuse"
    record_property("fault_outcome", f"retried, ready after {d['attempts']} attempts; generate: {outcome}")


def test_build_committed_unanswered_store_killed(stack, acknowledged, record_property):
    """The store held after its commit script ran (the generation is committed in the index) but before it
    answered: SIGKILL it. The builder's retry finds that generation committed (AlreadyExists, then the manifest
    reads) and marks it ready: no second generation."""
    record_property("fault", ("build committed, answer not sent", "store"))
    stack.restart("store", env={"REDKNOT_STORE_FAILPOINTS": "commit.after_script"})
    store = stack.services["store"]
    with api(stack) as c:
        doc = upload(c, acknowledged, TEXTS[3])["id"]
        wait_log(store, "FAILPOINT commit.after_script reached")
        store.kill()
        restart_killed(stack, "store", REDKNOT_STORE_FAILPOINTS="")
        d = wait_status(c, doc, {"ready", "failed"}, timeout=WAIT_S)
    assert d["status"] == "ready" and d["generation"] == 1 and d["generations"] == [1] and d["attempts"] >= 2, d
    outcome = served(stack, [doc])
    assert outcome == "reuse"
    record_property("fault_outcome", f"the retry found it committed: ready, generation 1; generate: {outcome}")


# ----------------------------------------------------------------------------------------------- generate

def fresh_documents(stack, acknowledged, texts: list[str]) -> list[str]:
    """Built documents that no request has fetched yet (none is in the worker's tier)."""
    with api(stack) as c:
        ids = [upload(c, acknowledged, t)["id"] for t in texts]
        for i in ids:
            assert wait_status(c, i, {"ready", "failed"}, timeout=WAIT_S)["status"] == "ready"
    return ids


def test_generate_fetching_store_killed(stack, acknowledged, record_property):
    """A reuse request taken by the worker, nothing fetched yet: SIGKILL the store. The request answers 200 with
    the counted fallback store_unavailable; re-uploading a ready document meanwhile answers 200 and queues
    nothing (its artifact cannot be checked, so it is not called broken); after the restart the request reuses."""
    record_property("fault", ("generate fetching", "store"))
    ids = fresh_documents(stack, acknowledged, TEXTS[4:6])
    before = fallbacks(stack)
    r = generate_killing(stack, ids, "store")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["arm"] == "recompute" and out["fallback"]["reason"] == "store_unavailable", out
    after = fallbacks(stack)
    assert after["store_unavailable"] == before["store_unavailable"] + 1
    assert sum(after.values()) == sum(before.values()) + 1
    with api(stack) as c:
        again = upload(c, acknowledged, TEXTS[4], want=200)
        assert again["status"] == "ready" and again["generation"] == 1
    restart_killed(stack, "store")
    outcome = served(stack, ids)
    assert outcome == "reuse"
    record_property("fault_outcome", f"counted fallback store_unavailable; re-upload 200; after restart: {outcome}")


def test_generate_in_worker_redis_killed(stack, acknowledged, record_property):
    """A reuse request in the worker (the API read its records already): SIGKILL redis-server. The request still
    answers by reuse (the worker needs no Redis); a request that needs the registry gets 503 until it is back;
    then generate reuses and uploads build again (the builder and the store found Redis again)."""
    record_property("fault", ("generate in the worker", "redis-server"))
    ids = list(acknowledged)[:2]
    r = generate_killing(stack, ids, "redis")
    assert r.status_code == 200 and r.json()["arm"] == "reuse" and r.json()["fallback"] is None, r.text
    down = post_generate(stack, ids)
    assert down.status_code == 503 and "Redis" in down.json()["detail"], down.text
    restart_killed(stack, "redis")
    outcome = served(stack, ids)
    assert outcome == "reuse"
    (doc,) = fresh_documents(stack, acknowledged, [TEXTS[0] + TEXTS[5]])
    assert served(stack, [doc]) == "reuse"
    record_property("fault_outcome", f"answered by reuse; 503 while down; after restart: {outcome}, builds resume")


def test_generate_heals_with_the_builder_killed(stack, acknowledged, record_property):
    """A request meets a document whose shard is corrupt in the store, with the builder SIGKILLed: it answers 200
    with the counted fallback and queues one rebuild; while the builder is down the next request falls back the
    same way (counted, no second rebuild); the restarted builder builds generation 2, which reuses."""
    record_property("fault", ("generate met a broken artifact, rebuild queued", "builder"))
    text = TEXTS[1] + TEXTS[3]
    (doc,) = fresh_documents(stack, acknowledged, [text])
    stack.services["builder"].kill()
    corrupt_local_shard(stack, stack.cfg.model, "acme", doc_tokens(stack.cfg.model, text), rank=0)
    rebuilds = lambda: scrape(stack.metrics_targets()["api"])[  # noqa: E731
        'redknot_rebuilds_total{reason="digest_mismatch"}']
    before = rebuilds()
    first, second = served(stack, [doc]), served(stack, [doc])
    assert first == second == "counted fallback digest_mismatch", (first, second)
    assert rebuilds() == before + 1
    with api(stack) as c:
        d = c.get(f"/v1/documents/{doc}").json()
        assert d["status"] == "queued" and d["generation"] == 1, d
        restart_killed(stack, "builder")
        d = wait_status(c, doc, {"ready", "failed"}, timeout=WAIT_S, generation=2)
    assert d["status"] == "ready", d
    outcome = served(stack, [doc])
    assert outcome == "reuse"
    record_property("fault_outcome", f"2 counted fallbacks, 1 rebuild; generation 2 ready; generate: {outcome}")


# ------------------------------------------------------------------------------------------------- at the end

def test_no_acknowledged_document_is_lost(stack, acknowledged, record_property):
    """Every upload acknowledged in this module is listed, readable and ready (none failed), and a request over
    several of them answers 200 by reuse or a counted fallback."""
    record_property("fault", ("after every drill", "-"))
    assert len(acknowledged) >= 8
    with api(stack) as c:
        listed = {d["id"] for d in c.get("/v1/documents", params={"page_size": 100}).json()["documents"]}
        docs = [wait_status(c, i, {"ready", "failed"}, timeout=WAIT_S) for i in acknowledged if i in listed]
    assert set(acknowledged) <= listed
    lost = len(set(acknowledged) - listed)
    broken = sum(d["status"] != "ready" for d in docs)
    record_property("fault_counts", ("SIGKILL drill", {"acknowledged": len(acknowledged), "documents lost": lost,
                                                       "broken documents left": broken}))
    assert all(d["status"] == "ready" for d in docs), [d for d in docs if d["status"] != "ready"]
    outcome = served(stack, list(acknowledged)[:4])
    record_property("fault_outcome", f"{len(acknowledged)} acknowledged documents listed and ready; generate: "
                                     f"{outcome}")
