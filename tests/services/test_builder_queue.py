"""The build queue on a real Redis and the builder's job logic in-process (TP=1, a tiny checkpoint): at-least-once
redelivery after a crash, retries with backoff, the dead-letter stream, idempotent commits by content hash."""
from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import redis

from runtime.model.checkpoint import build_demo_tokenizer, load_tokenizer, random_state, write_official_checkpoint
from runtime.model.config import tiny
from runtime.model.loader import load_model
from services.builder.builder import Builder, retry_delay
from services.builder.metrics import BuilderMetrics
from services.builder.settings import BuilderSettings
from services.common.build_queue import BuildQueue
from services.common.registry import Registry
from runtime.reuse.profile import load_profile
from services.common.serving import checkpoint_identity
from services.common.tenants import Tenants
from services.common.tp import RankGroup
from services.store.keys import DocumentKey

from .conftest import TOKENS, started_redis_service

PROFILE = json.dumps({"name": "q-test", "first_fences": 2, "last_fences": 2, "align": 16, "recent_rows": 16,
                      "join_rows": 8})


@pytest.fixture
def r(redis_url, prefix):
    return redis.Redis.from_url(redis_url)


def test_queue_redelivers_a_crashed_job_and_counts_depth(r, prefix):
    reg, q = Registry(r, prefix), BuildQueue(r, prefix, claim_idle_ms=60_000)
    q.ensure_group()
    rec, queued = reg.create("acme", "a" * 32, [5, 6, 7], "tokens")
    assert queued and rec.status == "queued" and rec.target_generation == 1
    assert reg.create("acme", "a" * 32, [5, 6, 7], "tokens")[1] is False      # idempotent: nothing enqueued
    assert q.depth() == 1 and r.xlen(q.stream) == 1
    job = q.claim("builder-a", block_ms=10)
    assert (job.tenant, job.doc) == ("acme", "a" * 32) and q.depth() == 1       # pending until acknowledged
    assert q.claim("builder-b", block_ms=10) is None                             # not idle long enough
    assert q.claim("builder-a", block_ms=10) == job                              # a restarted a resumes its own
    quick = BuildQueue(r, prefix, claim_idle_ms=50)
    time.sleep(0.1)
    assert quick.claim("builder-b", block_ms=10) == job                          # b takes over a dead a's job
    q.done(job)
    assert q.depth() == 0 and q.claim("builder-a", block_ms=10) is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d, tok = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_demo_tokenizer(512, tok)
    cfg = tiny(vocab_size=load_tokenizer(tok).get_vocab_size())
    write_official_checkpoint(d, cfg, random_state(cfg, seed=7), quantize=False, tokenizer_json=tok)
    return d


def make_builder(checkpoint, r, prefix, tmp_path, store_target: str, **kw) -> Builder:
    s = BuilderSettings(model=str(checkpoint), profile=PROFILE, store=store_target, consumer="b0",
                        workdir=str(tmp_path / f"work-{uuid.uuid4().hex[:6]}"), backoff_s=0.2, **kw)
    from runtime.model.parallel import Parallel
    import torch
    b = Builder(RankGroup(0, 1, torch.device("cpu"), Parallel()), load_model(checkpoint), load_profile(PROFILE),
                checkpoint_identity(checkpoint), s, BuildQueue(r, prefix), Registry(r, prefix), Tenants(TOKENS),
                BuilderMetrics())
    b.queue.ensure_group()
    b.workdir.mkdir(parents=True)
    return b


def test_builder_retries_with_backoff_then_dead_letters_then_builds_idempotently(checkpoint, r, prefix, tmp_path,
                                                                                   store):
    tokens = load_tokenizer(checkpoint).encode("The river runs past the old mill. " * 3).ids
    reg = Registry(r, prefix)
    reg.create("acme", "d" * 32, tokens, "text")
    # a store nobody listens on: every attempt fails with Unavailable
    down = make_builder(checkpoint, r, prefix, tmp_path, "127.0.0.1:9", max_attempts=2)
    job = down.queue.claim("b0", block_ms=10)
    down.process(job)
    rec = reg.get("acme", "d" * 32)
    assert rec.status == "queued" and rec.stage.startswith("retry in 0.2") and "Unavailable" in rec.error
    assert down.queue.depth() == 1 and down.queue.claim("b0", block_ms=10) is None       # waiting out the backoff
    time.sleep(0.3)
    job = down.queue.claim("b0", block_ms=10)
    assert job is not None and job.doc == "d" * 32
    down.process(job)
    rec = reg.get("acme", "d" * 32)
    assert rec.status == "failed" and rec.attempts == 2 and down.queue.depth() == 0
    dead = down.queue.dead_letters()
    assert len(dead) == 1 and dead[0]["doc"] == "d" * 32 and "Unavailable" in dead[0]["error"]
    m = down.metrics.builds
    assert [m.labels(x)._value.get() for x in ("ok", "retry", "dead_letter")] == [0, 1, 1]
    assert not any(down.workdir.iterdir())                        # nothing half-built is left behind

    # uploading it again queues it again; with the store up it builds
    assert reg.create("acme", "d" * 32, tokens, "text")[1] is True
    up = make_builder(checkpoint, r, prefix, tmp_path, store.target)
    up.process(up.queue.claim("b0", block_ms=10))
    rec = reg.get("acme", "d" * 32)
    assert rec.status == "ready" and rec.generation == 1 and rec.shards > 0 and rec.attempts == 1
    with store.client() as c:
        assert c.manifest(DocumentKey.from_dict(rec.key)).current_generation == 1
    # a duplicate delivery of a finished job only acknowledges it
    r.xadd(up.queue.stream, {"tenant": "acme", "doc": "d" * 32})
    up.process(up.queue.claim("b0", block_ms=10))
    assert reg.get("acme", "d" * 32).attempts == 1 and up.queue.depth() == 0
    # a crash after the commit but before the registry update: the rerun finds the generation committed
    reg.update("acme", "d" * 32, status="building")
    r.xadd(up.queue.stream, {"tenant": "acme", "doc": "d" * 32})
    up.process(up.queue.claim("b0", block_ms=10))
    rec = reg.get("acme", "d" * 32)
    assert rec.status == "ready" and rec.generation == 1 and rec.attempts == 2
    assert up.metrics.builds.labels("ok")._value.get() == 2


def _until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.05)


def test_builder_outlives_a_redis_kill_and_a_corrupt_record(checkpoint, tmp_path, store):
    """The builder's loop on its own real redis-server (AOF, as the local stack and the chart run it): SIGKILL of
    Redis while the loop runs does not stop it (it backs off, counted), a document uploaded after Redis is back is
    built, and a job whose registry record is unreadable is dead-lettered with that reason while the next job
    builds."""
    rs, port = started_redis_service(tmp_path)
    r = redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=2, health_check_interval=1)
    prefix = "rkbuilder"
    b = make_builder(checkpoint, r, prefix, tmp_path, store.target)
    loop = threading.Thread(target=b.run, daemon=True)
    loop.start()
    reg = Registry(r, prefix)
    tokenizer = load_tokenizer(checkpoint)
    try:
        reg.create("acme", "d" * 32, tokenizer.encode("The ferry crosses at dawn and at dusk. " * 2).ids, "text")
        _until(lambda: reg.get("acme", "d" * 32).status == "ready", 120, "a build before the kill")
        rs.kill()
        _until(lambda: b.metrics.redis_errors._value.get() >= 2, 30, "the loop meets the dead Redis")
        assert loop.is_alive()
        rs.start(tmp_path)
        rs.wait_ready(30)
        tokens = tokenizer.encode("A lock keeper logs every barge that passes the weir. " * 2).ids
        reg.create("acme", "e" * 32, tokens, "text")
        _until(lambda: reg.get("acme", "e" * 32).status == "ready", 120, "the document uploaded after the restart")
        assert loop.is_alive()

        r.hset(reg._doc("acme", "d" * 32), "generation", "one")       # d's record no longer parses
        r.xadd(b.queue.stream, {"tenant": "acme", "doc": "d" * 32})      # a redelivery of d's job
        reg.create("acme", "g" * 32, tokens[3:], "text")
        _until(lambda: reg.get("acme", "g" * 32).status == "ready", 120, "the job after the corrupt one")
        dead = b.queue.dead_letters()
        assert [d["doc"] for d in dead] == ["d" * 32] and "unreadable" in dead[0]["error"]
        assert loop.is_alive() and b.queue.depth() == 0
    finally:
        b.stop.set()
        loop.join(30)
        rs.stop()
    assert not loop.is_alive()


def test_a_job_whose_tokens_are_gone_is_dead_lettered_at_once(checkpoint, r, prefix, tmp_path, store):
    reg = Registry(r, prefix)
    reg.create("acme", "h" * 32, [5, 6, 7, 8], "tokens")
    r.delete(reg._tokens("acme", "h" * 32))
    b = make_builder(checkpoint, r, prefix, tmp_path, store.target, max_attempts=4)
    b.process(b.queue.claim("b0", block_ms=10))
    dead = b.queue.dead_letters()
    assert [d["doc"] for d in dead] == ["h" * 32] and "tokens are missing" in dead[0]["error"]
    rec = reg.get("acme", "h" * 32)
    assert rec.status == "failed" and rec.attempts == 1 and b.queue.depth() == 0      # no retry of what cannot heal


def test_default_retries_outlast_a_store_restart():
    """With the default settings a build waits two minutes in all before its last attempt (a store restart takes
    seconds), the waits doubling and bounded."""
    s = BuilderSettings()
    waits = [retry_delay(s, a) for a in range(1, s.max_attempts)]
    assert sum(waits) >= 120 and all(w <= s.backoff_max_s for w in waits)
    assert waits == sorted(waits) and waits[0] == s.backoff_s


def test_registry_rebuild_queues_a_broken_generation_once(r, prefix):
    reg, q = Registry(r, prefix), BuildQueue(r, prefix)
    q.ensure_group()
    reg.create("acme", "k" * 32, [5, 6, 7], "tokens")
    q.done(q.claim("b0", block_ms=10))
    assert not reg.rebuild("acme", "k" * 32, 1, "digest_mismatch")          # queued, not ready: nothing to heal
    reg.mark_ready("acme", "k" * 32, 1, {"doc_id": "x"}, 10, 2, 0.1)
    assert not reg.rebuild("acme", "k" * 32, 2, "digest_mismatch")          # not the current generation
    assert reg.rebuild("acme", "k" * 32, 1, "digest_mismatch")
    assert not reg.rebuild("acme", "k" * 32, 1, "missing_shard")            # already queued: one rebuild
    rec = reg.get("acme", "k" * 32)
    assert (rec.status, rec.generation, rec.target_generation) == ("queued", 1, 2)
    assert rec.stage == "rebuild: digest_mismatch" and q.depth() == 1
    q.done(q.claim("b0", block_ms=10))
    reg.mark_ready("acme", "k" * 32, 2, {"doc_id": "x"}, 10, 2, 0.1)
    reg.mark_retired("acme", "k" * 32, 2)
    reg.create("acme", "k" * 32, [5, 6, 7], "tokens")                         # uploaded again: generation 3
    q.done(q.claim("b0", block_ms=10))
    reg.mark_ready("acme", "k" * 32, 3, {"doc_id": "x"}, 10, 2, 0.1)
    r.hset(reg._doc("acme", "k" * 32), "retired", "[2, 7]")                  # a retired number above: never reused
    assert reg.rebuild("acme", "k" * 32, 3, "missing_layer")
    assert reg.get("acme", "k" * 32).target_generation == 8
    assert not reg.rebuild("nobody", "k" * 32, 3, "missing_layer")           # no record: nothing is created
    assert reg.get("nobody", "k" * 32) is None
