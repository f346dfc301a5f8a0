"""The whole service over loopback: real Redis, the store, the API, the builder and a TP=2 worker (gloo) as
separate processes on a tiny checkpoint; a real Prometheus scraping them; schemathesis against the OpenAPI
document. Tests run in file order and share one stack; the crash tests restart what they kill."""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from runtime.model.checkpoint import load_tokenizer
from runtime.reuse.certificate import FallbackReason
from services.common.build_queue import stream_key
from runtime.reuse.profile import load_profile
from services.common.serving import Binding, checkpoint_identity
from services.common.stack import free_port
from services.store.client import StoreClient
from services.store.errors import NotFound
from services.store.keys import DocumentKey, ShardKind

from .conftest import running_stack, scrape, write_tiny_checkpoint

TENANTS = {"acme": "acme-token-0123456789abcdef", "globex": "globex-token-0123456789abcdef",
           "fuzz": "fuzz-token-0123456789abcdef"}
PROFILE = json.dumps({"name": "svc-test", "first_fences": 2, "last_fences": 2, "align": 16, "budget": 0.25,
                      "recent_rows": 16, "join_rows": 8})
MAX_UPLOAD = 64 << 10
MAX_TOKENS = 2048
WAIT_S = 90.0
TEXTS = [
    "The river runs past the old mill and under the stone bridge before it reaches the sea. ",
    "In the morning the fishermen check their nets, the baker opens her shop, and the children walk to school. ",
    "Nobody in the town remembers when the bridge was built, but it has survived every flood for three hundred "
    "years. ",
    "Travelers often ask where the river begins, how deep it is, and why the water is so clear. ",
]
QUESTION = "Where does the river begin?"


# ------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, checkpoint, redis_url):
    yield from running_stack(tmp_path_factory, checkpoint, redis_url, "rksvc", tp=2, profile=PROFILE, tenants=TENANTS,
                             api_env={"REDKNOT_API_MAX_UPLOAD_BYTES": str(MAX_UPLOAD),
                                      "REDKNOT_API_MAX_DOCUMENT_TOKENS": str(MAX_TOKENS)},
                             builder_env={"REDKNOT_BUILDER_BACKOFF_S": "0.2", "REDKNOT_BUILDER_CLAIM_IDLE_S": "5"})


def api(stack, tenant: str = "acme") -> httpx.Client:
    return httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {TENANTS[tenant]}"}, timeout=120)


def upload(c: httpx.Client, text: str) -> str:
    r = c.post("/v1/documents", json={"text": text})
    assert r.status_code in (200, 202), r.text
    return r.json()["id"]


def wait_status(c: httpx.Client, doc_id: str, want: set[str], timeout: float = WAIT_S, **match) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        d = c.get(f"/v1/documents/{doc_id}").json()
        if d["status"] in want and all(d.get(k) == v for k, v in match.items()):
            return d
        assert time.monotonic() < deadline, f"document {doc_id} still {d} after {timeout}s"
        time.sleep(0.1)


def generate(c: httpx.Client, ids: list[str], arm: str = "reuse", n: int = 4, question: str = QUESTION) -> dict:
    r = c.post("/v1/generate", json={"documents": ids, "question": question, "max_new_tokens": n, "arm": arm})
    assert r.status_code == 200, r.text
    return r.json()


def fallbacks(stack) -> dict[str, float]:
    m = scrape(stack.metrics_targets()["worker"])
    return {k.split('"')[1]: v for k, v in m.items() if k.startswith("redknot_fallbacks_total{")}


def binding(checkpoint) -> Binding:
    return Binding(checkpoint_identity(checkpoint), load_profile(PROFILE), 2, 1)


def doc_tokens(checkpoint, text: str) -> list[int]:
    return load_tokenizer(checkpoint).encode(text).ids


@pytest.fixture(scope="module")
def built(stack):
    """Two documents of acme, built."""
    with api(stack) as c:
        ids = [upload(c, TEXTS[0] * 3), upload(c, TEXTS[1] * 3)]
        for i in ids:
            wait_status(c, i, {"ready"})
    return ids


# ------------------------------------------------------------------------------------------------- the flow

def test_upload_build_generate_with_reuse(stack, built):
    with api(stack) as c:
        for i in built:
            d = c.get(f"/v1/documents/{i}").json()
            assert d["status"] == "ready" and d["generation"] == 1 and d["generations"] == [1]
            assert d["progress"] == 1.0 and d["attempts"] == 1 and d["bytes"] > 0 and d["shards"] > 0
        # idempotent by content: the same text again is the same document, nothing is rebuilt
        r = c.post("/v1/documents", json={"text": TEXTS[0] * 3})
        assert r.status_code == 200 and r.json()["id"] == built[0] and r.json()["attempts"] == 1
        # the same content as token ids (multipart and text/plain bodies reach the same document too)
        toks = doc_tokens(stack.cfg.model, TEXTS[1] * 3)
        assert c.post("/v1/documents", json={"tokens": toks}).json()["id"] == built[1]
        assert c.post("/v1/documents", files={"file": ("d.txt", (TEXTS[0] * 3).encode())}).json()["id"] == built[0]
        assert c.post("/v1/documents", content=(TEXTS[1] * 3).encode(),
                      headers={"Content-Type": "text/plain"}).json()["id"] == built[1]
        page = c.get("/v1/documents", params={"page_size": 1}).json()
        assert page["total"] == 2 and len(page["documents"]) == 1 and page["next_page_token"] == "1"
        page2 = c.get("/v1/documents", params={"page_size": 1, "page_token": "1"}).json()
        assert page2["next_page_token"] is None and page2["documents"][0]["id"] != page["documents"][0]["id"]

        before = fallbacks(stack)
        out = generate(c, built, "reuse")
        assert out["arm"] == "reuse" and out["fallback"] is None
        assert len(out["tokens"]) >= 1 and isinstance(out["answer"], str)
        led = out["ledger"]
        assert 0 < led["token_row_saving"] <= 1 and 0 < led["flop_saving"]["total"] < 1
        assert set(led["flop_saving"]) == {"projections", "attention", "indexer", "moe", "total", "ratio"}
        assert led["rows"]["relocated"] > 0 and led["rows"]["active"] > 0
        assert led["ttft_s"] == {"reuse": out["ttft_s"]} and out["ttft_s"] > 0
        again = generate(c, built, "reuse")               # hot: served from the host tier
        assert again["tokens"] == out["tokens"] and again["fetch_s"] < 1.0
        rec = generate(c, built, "recompute")
        assert rec["arm"] == "recompute" and rec["ledger"] is None and rec["fallback"] is None
        assert fallbacks(stack) == before and sum(before.values()) == 0
    m = scrape(stack.metrics_targets()["worker"])
    assert m['redknot_cache_tier_requests_total{reason="resident",result="hit",tier="host"}'] >= 4   # 2 ranks x 2 docs
    assert m['redknot_tier_bytes{rank="0"}'] > 0 and m['redknot_tier_bytes{rank="1"}'] > 0
    assert m['redknot_tier_evictions_total{rank="0"}'] == 0
    assert m["redknot_artifact_fetch_bytes_total"] > 0
    # tp 2: each rank fetched the latent shards of half the layers; the other half came from the other rank
    assert m["redknot_artifact_exchange_bytes_total"] > 0
    assert m['redknot_ttft_seconds_count{arm="reuse"}'] >= 2


def local_shard_blob(stack, checkpoint, tenant: str, tokens: list[int], rank: int) -> Path:
    """The file of a LOCAL shard of `rank` of the current generation in the store's blob directory (fs backend)."""
    key = binding(checkpoint).store_key(tokens)
    with StoreClient(stack.store_target, TENANTS[tenant]) as client:
        shards = client.manifest(key).manifest.select(rank)
    spec = next(s for s in shards if s.kind is ShardKind.LOCAL)
    path = stack.workdir / "store" / "blobs" / tenant / key.doc_id / spec.digest[:2] / spec.digest
    assert path.is_file(), path
    return path


def corrupt_local_shard(stack, checkpoint, tenant: str, tokens: list[int], rank: int) -> None:
    """Flip one byte of a LOCAL shard of `rank` in the store's blob directory (its size stays)."""
    path = local_shard_blob(stack, checkpoint, tenant, tokens, rank)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def test_corrupted_shard_is_a_counted_fallback_with_the_recompute_answer(stack, checkpoint):
    with api(stack) as c:
        ids = [upload(c, TEXTS[2] * 2), upload(c, TEXTS[3] * 2)]
        for i in ids:
            wait_status(c, i, {"ready"})
        corrupt_local_shard(stack, checkpoint, "acme", doc_tokens(checkpoint, TEXTS[3] * 2), rank=1)
        before = fallbacks(stack)
        out = generate(c, ids, "reuse")
        rec = generate(c, ids, "recompute")
    assert out["arm"] == "recompute" and out["ledger"] is None
    assert out["fallback"]["reason"] == "digest_mismatch"
    # rank 0 lacks the shared shards rank 1 fetches for both (the same stream failed): it follows rank 1, which names
    # the cause
    assert out["fallback"]["ranks"] == ["rank_disagreement", "digest_mismatch"]
    assert out["fallback"]["detail"].startswith("rank 1: "), out["fallback"]
    assert out["tokens"] == rec["tokens"] and out["answer"] == rec["answer"]
    after = fallbacks(stack)
    assert after["digest_mismatch"] == before["digest_mismatch"] + 1
    assert sum(after.values()) == sum(before.values()) + 1
    # self-healing: the broken document (named by the fallback) is rebuilt under a new generation, once, and then
    # the same request reuses
    assert out["fallback"]["document"] == ids[1]
    assert scrape(stack.metrics_targets()["api"])['redknot_rebuilds_total{reason="digest_mismatch"}'] == 1
    with api(stack) as c:
        doc = wait_status(c, ids[1], {"ready"}, generation=2)
        assert doc["generation"] == 2 and c.get(f"/v1/documents/{ids[0]}").json()["generation"] == 1
        healed = generate(c, ids, "reuse")
    assert healed["arm"] == "reuse" and healed["fallback"] is None
    assert scrape(stack.metrics_targets()["api"])['redknot_rebuilds_total{reason="digest_mismatch"}'] == 1


def test_uploading_a_broken_document_again_rebuilds_it_before_any_request_meets_it(stack, checkpoint):
    """A ready document whose artifact the store can no longer serve (one shard's byte flipped; another's shard
    deleted; a third's generation gone from the store's index), met by no request yet: uploading the same content
    again answers 202, queues one rebuild under a new generation (counted by reason), and the next request reuses
    it. A healthy ready document answers 200 and queues nothing, before and after."""
    texts = [TEXTS[0] + TEXTS[2], TEXTS[3] + TEXTS[0], TEXTS[1] + TEXTS[2]]
    reasons = ("digest_mismatch", "missing_shard")
    rebuilds = lambda: {r: scrape(stack.metrics_targets()["api"])[f'redknot_rebuilds_total{{reason="{r}"}}']  # noqa
                        for r in reasons}
    with api(stack) as c:
        ids = [upload(c, t) for t in texts]
        for i in ids:
            wait_status(c, i, {"ready"})
        before, fb_before = rebuilds(), fallbacks(stack)
        healthy = c.post("/v1/documents", json={"text": texts[0]})
        assert healthy.status_code == 200 and healthy.json()["generation"] == 1 and healthy.json()["attempts"] == 1
        assert rebuilds() == before
        corrupt_local_shard(stack, checkpoint, "acme", doc_tokens(checkpoint, texts[0]), rank=0)
        local_shard_blob(stack, checkpoint, "acme", doc_tokens(checkpoint, texts[1]), rank=1).unlink()
        with StoreClient(stack.store_target, TENANTS["acme"]) as client:     # behind the registry's back
            client.retire(binding(checkpoint).store_key(doc_tokens(checkpoint, texts[2])), 1)
        for t, i in zip(texts, ids):
            r = c.post("/v1/documents", json={"text": t})
            assert r.status_code == 202 and r.json()["id"] == i, r.text
            assert r.json()["status"] in ("queued", "building") and r.json()["generation"] == 1    # until rebuilt
        assert rebuilds() == {"digest_mismatch": before["digest_mismatch"] + 1,
                              "missing_shard": before["missing_shard"] + 2}
        for i in ids:
            d = wait_status(c, i, {"ready"}, generation=2)
            assert d["attempts"] == 1 and 2 in d["generations"]
        out = generate(c, ids, "reuse")
        assert out["arm"] == "reuse" and out["fallback"] is None
        assert [d["generation"] for d in out["documents"]] == [2, 2, 2]
        again = c.post("/v1/documents", json={"text": texts[1]})            # healthy again: nothing is queued
        assert again.status_code == 200 and again.json()["generation"] == 2
    assert rebuilds()["missing_shard"] == before["missing_shard"] + 2
    assert fallbacks(stack) == fb_before                                    # no request ever met the broken ones


def test_parallel_requests_show_their_queueing_in_the_latency_metrics(stack, built):
    """Three requests at once on one worker group (it computes one at a time): the API's histograms count from
    arrival, so the waits show (queue time > 0, in the time to first token too), each first token comes before its
    response, and the worker's running/waiting gauges are back to 0 after."""
    def sums(m: dict, name: str) -> tuple[float, float]:
        return m[f'{name}_sum{{arm="reuse"}}'], m[f'{name}_count{{arm="reuse"}}']
    names = ("redknot_request_queue_seconds", "redknot_time_to_first_token_seconds",
             "redknot_e2e_request_latency_seconds")
    before = scrape(stack.metrics_targets()["api"])
    # the three requests leave together: each client's connection is open before a barrier (a served TTFT here is
    # tens of ms, so clients made and connected inside the threads arrived spread over about one forward, and the
    # later ones found little to wait for)
    clients = [api(stack) for _ in range(3)]
    start = threading.Barrier(3)

    def one(c):
        assert c.get("/healthz").status_code == 200
        start.wait(timeout=30)
        return generate(c, built, "reuse", n=2)
    try:
        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(one, clients))
    finally:
        for c in clients:
            c.close()
    assert all(o["arm"] == "reuse" for o in outs)
    after = scrape(stack.metrics_targets()["api"])
    (q, nq), (f, nf), (e, ne) = [tuple(a - b for a, b in zip(sums(after, n), sums(before, n))) for n in names]
    assert nq == nf == ne == 3
    assert q > 0 and f > q and e > f
    # the two requests that waited waited at least one request's forward: more than the served TTFT of one
    assert q > min(o["ttft_s"] for o in outs)
    worker = scrape(stack.metrics_targets()["worker"])
    assert worker["redknot_requests_running"] == 0 and worker["redknot_requests_waiting"] == 0


def test_document_ids_are_keyed_per_tenant(stack, checkpoint):
    """The same text uploaded by two tenants gets two ids (each idempotent within its tenant), and neither is the
    unkeyed content hash: an id does not confirm a guessed text to whoever lacks the deployment's key."""
    from runtime.reuse.certificate import token_hash
    from services.common.serving import tokenizer_fingerprint
    text = TEXTS[2] + TEXTS[1]
    with api(stack) as acme, api(stack, "globex") as globex:
        a, g = upload(acme, text), upload(globex, text)
        assert a != g and upload(acme, text) == a and upload(globex, text) == g
    unkeyed = token_hash(doc_tokens(checkpoint, text), tokenizer_fingerprint(checkpoint))[:32]
    assert unkeyed not in (a, g)


def test_a_document_and_the_same_ids_plus_a_pad_token_are_apart(stack, checkpoint):
    """T and T+[pad] pad to the same ids; their store keys differ (a key is a function of exactly the unpadded ids),
    so deleting one leaves the other served by reuse, and uploading T again changes nothing."""
    t = doc_tokens(checkpoint, TEXTS[1] + TEXTS[3])
    t = t[:len(t) - len(t) % 16 + 5]                          # 5 past a multiple of the profile's align: padded
    b = binding(checkpoint)
    assert b.store_key(t) != b.store_key(t + [b.eos])
    with api(stack) as c:
        ids = [c.post("/v1/documents", json={"tokens": toks}).json()["id"] for toks in (t, t + [b.eos])]
        assert ids[0] != ids[1]
        for i in ids:
            wait_status(c, i, {"ready"})
        assert c.delete(f"/v1/documents/{ids[1]}").status_code == 200
        out = generate(c, [ids[0]], "reuse")
        assert out["arm"] == "reuse" and out["fallback"] is None
        again = c.post("/v1/documents", json={"tokens": t})
        assert again.status_code == 200 and again.json()["id"] == ids[0] and again.json()["status"] == "ready"


def test_retired_generation_is_a_counted_fallback_with_the_recompute_answer(stack, checkpoint, built):
    text = TEXTS[2] + TEXTS[0]
    with api(stack) as c:
        doc = upload(c, text)
        wait_status(c, doc, {"ready"})
        ids = [built[0], doc]
        assert generate(c, ids, "reuse")["arm"] == "reuse"           # every rank now holds generation 1
        r = c.delete(f"/v1/documents/{doc}")
        assert r.status_code == 200 and r.json()["status"] == "retired"
        assert r.json()["retired_generations"] == [1] and r.json()["generation"] == 0
        assert c.delete(f"/v1/documents/{doc}").status_code == 200   # retiring again changes nothing
        with StoreClient(stack.store_target, TENANTS["acme"]) as client, pytest.raises(NotFound):
            client.manifest(binding(checkpoint).store_key(doc_tokens(checkpoint, text)), 1)
        before = fallbacks(stack)
        out = generate(c, ids, "reuse")
        rec = generate(c, ids, "recompute")
        assert out["arm"] == "recompute" and out["fallback"]["reason"] == "stale_generation"
        assert out["tokens"] == rec["tokens"]
        assert fallbacks(stack)["stale_generation"] == before["stale_generation"] + 1
        # uploading it again builds a new generation (retired numbers are never reused), served with reuse
        r = c.post("/v1/documents", json={"text": text})
        assert r.status_code == 202
        d = wait_status(c, doc, {"ready"})
        assert d["generation"] == 2 and d["retired_generations"] == [1]
        again = generate(c, ids, "reuse")
        assert again["arm"] == "reuse" and again["documents"][1]["generation"] == 2


# --------------------------------------------------------------------------------------------- bad inputs

def _state(stack) -> dict:
    r = redis.Redis.from_url(stack.redis_url)
    keys = sorted(k.decode() for k in r.scan_iter(match=f"{stack.cfg.prefix}:*", count=1000))
    return {"keys": keys, "stream": r.xlen(stream_key(stack.cfg.prefix)),
            "docs": {k: r.hgetall(k) for k in keys if ":doc:" in k},
            "requests": {k: v for k, v in scrape(stack.metrics_targets()["worker"]).items()
                         if k.startswith("redknot_ttft_seconds_count")}}


def test_bad_inputs_get_clear_4xx_and_change_nothing(stack, built, checkpoint):
    vocab = load_tokenizer(checkpoint).get_vocab_size()
    other = built[0]
    before = _state(stack)
    acme, globex = api(stack), api(stack, "globex")
    anon = httpx.Client(base_url=stack.api_url, timeout=30)
    cases = [
        ("empty text", acme.post("/v1/documents", json={"text": ""}), 422),
        ("blank text", acme.post("/v1/documents", json={"text": "  \n\t "}), 422),
        ("empty tokens", acme.post("/v1/documents", json={"tokens": []}), 422),
        ("oversized body", acme.post("/v1/documents", json={"text": "x" * (MAX_UPLOAD + 10)}), 413),
        ("oversized multipart", acme.post("/v1/documents", files={"file": ("d.txt", b"y" * (MAX_UPLOAD + 10))}), 413),
        ("too many tokens", acme.post("/v1/documents", json={"tokens": [5] * (MAX_TOKENS + 1)}), 413),
        ("invalid UTF-8 text/plain", acme.post("/v1/documents", content=b"ok \xff\xfe bad",
                                               headers={"Content-Type": "text/plain"}), 422),
        ("invalid UTF-8 file", acme.post("/v1/documents", files={"file": ("d.txt", b"\xc3\x28 bad")}), 422),
        ("invalid UTF-8 JSON", acme.post("/v1/documents", content=b'{"text": "a\xffb"}',
                                         headers={"Content-Type": "application/json"}), 422),
        ("lone surrogate", acme.post("/v1/documents", content=b'{"text": "a\\ud800b"}',
                                     headers={"Content-Type": "application/json"}), 422),
        ("out-of-vocabulary id", acme.post("/v1/documents", json={"tokens": [3, vocab + 5]}), 422),
        ("negative id", acme.post("/v1/documents", json={"tokens": [3, -1]}), 422),
        ("text and tokens", acme.post("/v1/documents", json={"text": "a", "tokens": [3]}), 422),
        ("malformed JSON", acme.post("/v1/documents", content=b"{not json",
                                     headers={"Content-Type": "application/json"}), 422),
        ("unknown field", acme.post("/v1/documents", json={"text": "a", "owner": "x"}), 422),
        ("unsupported type", acme.post("/v1/documents", content=b"<doc/>",
                                       headers={"Content-Type": "application/xml"}), 415),
        ("multipart without file", acme.post("/v1/documents", files={"other": ("d.txt", b"abc")}), 422),
        ("unknown id", acme.get(f"/v1/documents/{'0' * 32}"), 404),
        ("malformed id", acme.get("/v1/documents/not-an-id"), 422),
        ("unknown id retire", acme.delete(f"/v1/documents/{'0' * 32}"), 404),
        ("unknown id generate", acme.post("/v1/generate", json={"documents": ["0" * 32], "question": "q"}), 404),
        ("another tenant's document", globex.get(f"/v1/documents/{other}"), 404),
        ("another tenant's retire", globex.delete(f"/v1/documents/{other}"), 404),
        ("another tenant's generate", globex.post("/v1/generate", json={"documents": [other], "question": "q"}), 404),
        ("no token", anon.get("/v1/documents"), 401),
        ("wrong token", anon.get("/v1/documents", headers={"Authorization": "Bearer nope-nope-nope-nope"}), 401),
        ("generate without question", acme.post("/v1/generate", json={"documents": [other]}), 422),
        ("generate empty question", acme.post("/v1/generate", json={"documents": [other], "question": " "}), 422),
        ("generate no documents", acme.post("/v1/generate", json={"documents": [], "question": "q"}), 422),
        ("generate bad arm", acme.post("/v1/generate", json={"documents": [other], "question": "q", "arm": "x"}), 422),
        ("generate zero tokens", acme.post("/v1/generate", json={"documents": [other], "question": "q",
                                                                  "max_new_tokens": 0}), 422),
        ("generate too many tokens", acme.post("/v1/generate", json={"documents": [other], "question": "q",
                                                                      "max_new_tokens": 100_000}), 422),
        ("generate malformed body", acme.post("/v1/generate", content=b"[1,2", headers={
            "Content-Type": "application/json"}), 422),
        ("bad page token", acme.get("/v1/documents", params={"page_token": "abc"}), 422),
        ("bad page size", acme.get("/v1/documents", params={"page_size": 0}), 422),
    ]
    for name, r, code in cases:
        assert r.status_code == code, f"{name}: {r.status_code} {r.text}"
        body = r.json()
        assert body["detail"], f"{name}: no detail in {body}"
    for c in (acme, globex, anon):
        c.close()
    assert _state(stack) == before


# ----------------------------------------------------------------------------------------------- prometheus

PROMETHEUS_CONFIG = """global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
{jobs}"""


def prometheus_query(url: str, q: str) -> dict[str, float]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": q}, timeout=10).json()
    assert r["status"] == "success", r
    return {json.dumps(s["metric"], sort_keys=True): float(s["value"][1]) for s in r["data"]["result"]}


@pytest.fixture
def prometheus(stack, tmp_path):
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.fail("no prometheus binary: .ci/run installs Debian's 'prometheus' package")
    jobs = "".join(f"  - job_name: {name}\n    static_configs:\n      - targets: ['{target}']\n"
                   for name, target in stack.metrics_targets().items())
    (tmp_path / "prometheus.yml").write_text(PROMETHEUS_CONFIG.format(jobs=jobs))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([exe, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready in 60s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def wait_query(url: str, q: str, check, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        got = prometheus_query(url, q)
        if check(got):
            return got
        assert time.monotonic() < deadline, f"{q}: {got}"
        time.sleep(0.5)


def test_prometheus_scrapes_api_store_worker_and_finds_savings_and_fallbacks(stack, built, prometheus):
    with api(stack) as c:
        out = generate(c, built, "reuse")
        assert out["arm"] == "reuse"
    ups = wait_query(prometheus, "up", lambda g: len(g) == 4 and all(v == 1 for v in g.values()))
    assert {json.loads(k)["job"] for k in ups} == {"api", "worker", "store", "builder"}
    worker = scrape(stack.metrics_targets()["worker"])
    api_m = scrape(stack.metrics_targets()["api"])
    expect = {
        'redknot_flop_saving_ratio_sum{op="total"}': worker['redknot_flop_saving_ratio_sum{op="total"}'],
        "redknot_flop_saving_ratio_count{op=\"total\"}": worker['redknot_flop_saving_ratio_count{op="total"}'],
        "redknot_head_row_saving_ratio_sum": worker["redknot_head_row_saving_ratio_sum"],
        "redknot_token_row_saving_ratio_sum": worker["redknot_token_row_saving_ratio_sum"],
        'redknot_ttft_seconds_count{arm="reuse"}': worker['redknot_ttft_seconds_count{arm="reuse"}'],
        'redknot_fallbacks_total{reason="digest_mismatch"}': worker['redknot_fallbacks_total{reason="digest_mismatch"}'],
        'redknot_fallbacks_total{reason="stale_generation"}': worker['redknot_fallbacks_total{reason="stale_generation"}'],
        'redknot_requests_total{arm="reuse",outcome="ok"}': api_m['redknot_requests_total{arm="reuse",outcome="ok"}'],
    }
    # the savings of the request just made are in the series (namespace 3, total)
    assert worker['redknot_flop_saving_ratio_count{op="total"}'] >= 1
    for q, want in expect.items():
        got = wait_query(prometheus, q, lambda g, w=want: len(g) == 1 and abs(next(iter(g.values())) - w) < 1e-9)
        assert abs(next(iter(got.values())) - want) < 1e-9, q
    # one series per fallback reason, every one present (zero or counted)
    reasons = prometheus_query(prometheus, "redknot_fallbacks_total")
    assert len(reasons) == len(FallbackReason)
    assert prometheus_query(prometheus, 'sum(redknot_fallbacks_total{job="worker"})')
    assert prometheus_query(prometheus, "redknot_store_shards_served_total")
    assert prometheus_query(prometheus, "redknot_build_queue_depth")
    assert prometheus_query(prometheus, 'redknot_builds_total{result="ok"}')


# ---------------------------------------------------------------------------------------------- crashes

def test_killing_the_builder_mid_job_loses_no_upload_and_shows_no_half_built_artifact(stack, checkpoint, built):
    b = stack.services["builder"]
    stack.restart("builder", env={"REDKNOT_BUILDER_FAILPOINTS": "before_commit=60"})
    text = TEXTS[3] + TEXTS[1]
    with api(stack) as c:
        doc = upload(c, text)
        wait_status(c, doc, {"building"}, stage="committing")      # every shard uploaded, not committed
        b.kill()
        d = c.get(f"/v1/documents/{doc}").json()
        assert d["status"] == "building" and d["generation"] == 0
        key: DocumentKey = binding(checkpoint).store_key(doc_tokens(checkpoint, text))
        with StoreClient(stack.store_target, TENANTS["acme"]) as client, pytest.raises(NotFound):
            client.manifest(key)                                    # nothing of it is readable
        out = generate(c, [built[0], doc], "reuse")
        assert out["arm"] == "recompute" and out["fallback"]["reason"] == "missing_shard"
        stack.restart("builder", env={"REDKNOT_BUILDER_FAILPOINTS": ""})
        d = wait_status(c, doc, {"ready"})
        assert d["generation"] == 1 and d["attempts"] == 2
        with StoreClient(stack.store_target, TENANTS["acme"]) as client:
            assert client.manifest(key).current_generation == 1
        out = generate(c, [built[0], doc], "reuse")
        assert out["arm"] == "reuse" and out["fallback"] is None


def test_killing_the_worker_mid_request_then_restarting_serves_with_reuse(stack, built):
    w = stack.services["worker"]
    with api(stack) as c:
        expected = generate(c, built, "reuse")
        assert expected["arm"] == "reuse"
    stack.restart("worker", env={"REDKNOT_WORKER_FAILPOINTS": "after_fetch=60"})
    result = {}

    def call():
        with api(stack) as c:
            result["r"] = c.post("/v1/generate", json={"documents": built, "question": QUESTION,
                                                         "max_new_tokens": 4})

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + WAIT_S
    while "FAILPOINT after_fetch reached" not in w.log(100_000):
        assert time.monotonic() < deadline and w.alive(), w.log()
        time.sleep(0.1)
    # it fetched into its pinned tier (every shard verified and kept in its memory), then stopped
    assert "rank 0 fetched" in w.log(100_000) and "rank 1 fetched" in w.log(100_000)
    w.kill()
    t.join(timeout=60)
    assert result["r"].status_code == 503 and "unreachable" in result["r"].json()["detail"]
    with api(stack) as c:
        doc = upload(c, TEXTS[0] + TEXTS[3])                        # uploads go on while the worker is down
        stack.restart("worker", env={"REDKNOT_WORKER_FAILPOINTS": ""})
        out = generate(c, built, "reuse")                           # the tier is memory: the fresh one fetches
        assert out["arm"] == "reuse" and out["fallback"] is None and out["tokens"] == expected["tokens"]
        assert wait_status(c, doc, {"ready"})["generation"] == 1
    assert sum(fallbacks(stack).values()) == 0                      # a fresh worker process counts from zero


# ------------------------------------------------------------------------------------------- schemathesis

def test_openapi_document_holds_under_schemathesis(stack):
    import hypothesis
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)

    schema = schemathesis.openapi.from_url(f"{stack.api_url}/openapi.json")
    headers = {"Authorization": f"Bearer {TENANTS['fuzz']}"}
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    deadline = time.monotonic() + 60.0                       # bounded in time, whatever hypothesis would do
    tested = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path == "/metrics":
            continue

        @hypothesis.settings(max_examples=15, deadline=None, database=None, derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
        @hypothesis.given(case=op.as_strategy())
        def run(case):
            if time.monotonic() > deadline:
                return
            case.call_and_validate(headers=headers, checks=checks, timeout=60)

        run()
        tested.append(f"{op.method.upper()} {op.path}")
    assert {"POST /v1/documents", "GET /v1/documents", "GET /v1/documents/{doc_id}", "DELETE /v1/documents/{doc_id}",
            "POST /v1/generate", "GET /healthz", "GET /readyz"} <= set(tested)
    assert urllib.parse.urlparse(stack.api_url).hostname == "127.0.0.1"
