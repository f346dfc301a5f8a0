"""Generations over time (readable until retired, GC deletes only unreferenced blobs), tenant isolation,
the store's certificate verdicts, listing, metrics, graceful shutdown and mTLS."""
from __future__ import annotations

import shutil
import subprocess
import threading
import time

import grpc
import pytest

from services.store.client import StoreClient, TlsConfig
from services.store.errors import NotFound, Unavailable
from services.store.keys import Range, Reason, ShardKind
from services.store.redis_client import sync_client

from .conftest import TOKENS, doc_key, fetch_all, make_generation


def blob_files(store) -> set[str]:
    return {p.name for p in (store.blob_root / "blobs").rglob("*") if p.is_file()}


def test_older_generations_stay_readable_until_retired_and_gc_deletes_only_unreferenced(store, client):
    key = doc_key("lifecycle")
    g1 = make_generation(key, tag="one")
    g2 = make_generation(key, tag="two")
    # generation 2 shares the certificates and manifests with generation 1 (same bytes), the rest differs
    g2 = [(s, d) if s.kind in (ShardKind.CERTIFICATE, ShardKind.MANIFEST) else (s, d) for s, d in g2]
    shared = {s.digest for s, _ in g1} & {s.digest for s, _ in g2}
    client.put_generation(key, g1)
    client.put_generation(key, g2)
    m = client.manifest(key)
    assert (m.current_generation, m.generations) == (2, (1, 2))
    assert fetch_all(client, key, 0, generation=1) == {s.name: d for s, d in g1 if s.rank == 0}

    # an open upload pins its declared blobs: GC leaves them even when no generation references them
    g3 = make_generation(key, tag="three")
    b3 = client.begin(key, [s for s, _ in g3])
    client.put(b3.upload_id, [(s, d) for s, d in g3 if s.rank == 0])

    assert client.retire(key, 2) == 1                   # the pointer falls back to the highest readable one
    with pytest.raises(NotFound):
        client.manifest(key, generation=2)
    with pytest.raises(NotFound):
        client.retire(key, 2)
    gc = client.collect_garbage(key)
    only_two = {s.digest for s, _ in g2} - {s.digest for s, _ in g1}
    assert gc.blobs_deleted == len(only_two) and gc.bytes_freed > 0
    files = blob_files(store)
    assert not (files & only_two)
    assert {s.digest for s, _ in g1} <= files and shared <= files
    assert {s.digest for s, d in g3 if s.rank == 0} <= files           # pinned by the open upload
    assert fetch_all(client, key, 1) == {s.name: d for s, d in g1 if s.rank == 1}

    # the open upload still commits, and a retired generation number is never reused
    client.put(b3.upload_id, [(s, d) for s, d in g3 if s.rank == 1])
    assert client.commit(b3.upload_id).manifest.generation == 3
    from services.store.errors import AlreadyExists
    with pytest.raises(AlreadyExists):
        client.begin(key, [s for s, _ in g2], generation=2)
    client.retire(key, 1)
    client.retire(key, 3)
    client.collect_garbage()
    assert not blob_files(store) & ({s.digest for s, _ in g1} | {s.digest for s, _ in g3})
    with pytest.raises(NotFound):
        client.manifest(key)
    assert key not in [d.key for d in client.list_documents()]


def test_tenants_cannot_see_each_other(store, client):
    key = doc_key("secret")
    client.put_generation(key, make_generation(key))
    with store.client("globex") as other:
        assert other.list_documents() == []
        assert other.list_documents(doc_hash=key.doc_hash) == []
        with pytest.raises(NotFound):
            other.manifest(key)
        with pytest.raises(NotFound):
            list(other.fetch(key, 0))
        with pytest.raises(NotFound):
            other.retire(key, 1)
        v = other.validate(key, 0)
        assert not v.ok and v.reason is Reason.MISSING_SHARD and v.certificate_digest == ""
        assert other.collect_garbage().blobs_deleted == 0
        # the same document under globex is a different document, with its own generations and blobs
        other.put_generation(key, make_generation(key, tag="globex"))
        assert fetch_all(other, key, 0) != fetch_all(client, key, 0)
    assert [d.key for d in client.list_documents()] == [key]


def test_validate_reasons(client):
    key = doc_key("validate", tp_size=2)
    gen = make_generation(key, layers=3)
    client.put_generation(key, gen)
    cert0 = next(s for s, _ in gen if s.rank == 0 and s.kind is ShardKind.CERTIFICATE)
    ok = client.validate(key, 0, channels=Range(0, 64), layers_needed=[0, 1, 2], generation=1,
                         certificate_digest=cert0.digest, deep=True)
    assert ok.ok and ok.current_generation == 1 and ok.certificate_digest == cert0.digest
    import dataclasses
    R = Reason
    cases = [
        (dict(key=dataclasses.replace(key, checkpoint_fingerprint="f" * 64)), R.CHECKPOINT_MISMATCH),
        (dict(key=dataclasses.replace(key, profile="pro-0123456789abcdef")), R.PROFILE_MISMATCH),
        (dict(key=dataclasses.replace(key, tp_size=4)), R.TP_GEOMETRY_MISMATCH),
        (dict(key=dataclasses.replace(key, doc_hash="e" * 64)), R.MISSING_SHARD),
        (dict(rank=2), R.TP_GEOMETRY_MISMATCH),
        (dict(channels=Range(64, 128)), R.TP_GEOMETRY_MISMATCH),
        (dict(layers_needed=[0, 3]), R.MISSING_LAYER),
        (dict(generation=7), R.STALE_GENERATION),
        (dict(certificate_digest="0" * 64), R.DIGEST_MISMATCH),
    ]
    for kw, reason in cases:
        args = dict(key=key, rank=0, channels=Range(0, 64), layers_needed=[0, 1, 2], generation=1)
        args.update(kw)
        v = client.validate(args.pop("key"), args.pop("rank"), **args)
        assert (v.ok, v.reason) == (False, reason), (kw, v)


def test_list_documents_pages(client):
    keys = [doc_key(f"list-{i}", tp_size=1) for i in range(7)]
    for k in keys:
        client.put_generation(k, make_generation(k, layers=1, size=64))
    got = client.list_documents(page_size=2)
    assert sorted(d.key.doc_hash for d in got) == sorted(k.doc_hash for k in keys)
    assert all(d.current_generation == 1 and d.generations == (1,) for d in got)
    assert [d.key for d in client.list_documents(doc_hash=keys[3].doc_hash)] == [keys[3]]


def test_metrics_endpoint(store, client):
    key = doc_key("metrics", tp_size=1)
    gen = make_generation(key, layers=2, size=1000)
    client.put_generation(key, gen)
    fetch_all(client, key, 0)
    total = sum(s.size for s, _ in gen)
    assert store.metric("redknot_store_bytes_in_total") == total
    assert store.metric("redknot_store_bytes_out_total", 'path="grpc"') == total
    assert store.metric("redknot_store_shards_stored_total") == len(gen)
    assert store.metric("redknot_store_shards_served_total", 'path="grpc"') == len(gen)
    assert store.metric("redknot_store_commits_total", 'result="ok"') == 1
    assert store.metric("redknot_store_rpcs_total", 'code="OK",method="FetchShards"') == 1
    assert store.metric("redknot_store_rpc_seconds_count", 'method="CommitGeneration"') == 1
    with pytest.raises(Exception):
        client.commit("0" * 32 + "." + "0" * 32)
    assert store.metric("redknot_store_commits_total", 'result="not_found"') == 1
    assert store.metric("redknot_store_rpcs_total", 'code="NOT_FOUND",method="CommitGeneration"') == 1


def test_port_zero_binds_free_ports_and_prints_them(store):
    """StoreProcess starts the store with --listen and --metrics-listen on port 0 (a port picked by the test and bound
    later by the child could be taken in between): the store binds ports of the kernel's choosing and prints them,
    and the printed ports are the ones serving gRPC and /metrics."""
    import urllib.request
    assert "127.0.0.1:0" in store.proc.args[store.proc.args.index("--listen") + 1]
    assert "127.0.0.1:0" in store.proc.args[store.proc.args.index("--metrics-listen") + 1]
    assert store.port > 0 and store.metrics_port > 0 and store.port != store.metrics_port
    log = store.log()
    assert f"redknot store: metrics on port {store.metrics_port}\n" in log
    assert f"redknot store: serving on port {store.port}\n" in log
    with StoreClient(store.target, TOKENS["acme"]) as c:
        assert list(c.list_documents()) == []
    text = urllib.request.urlopen(f"http://127.0.0.1:{store.metrics_port}/metrics", timeout=5).read().decode()
    assert "redknot_store_rpcs_total" in text


def test_graceful_shutdown_finishes_in_flight_fetches(store_factory):
    store = store_factory(extra_env={"REDKNOT_STORE_GRACE_S": "20"}).start()
    key = doc_key("shutdown", tp_size=1)
    gen = make_generation(key, layers=8, size=4 << 20)
    with store.client() as c:
        c.put_generation(key, gen)
        results, started = {}, threading.Event()

        def slow_reader():
            out = {}
            for i, s in enumerate(c.fetch(key, 0)):
                if i == 0:
                    started.set()
                    time.sleep(1.0)          # SIGTERM lands while this stream is open
                out[s.spec.name] = s.data
            results["data"] = out

        t = threading.Thread(target=slow_reader)
        t.start()
        assert started.wait(20)
        rc = store.terminate(timeout=30)
        t.join(30)
    assert rc == 0 and "stopped" in store.log()
    assert results["data"] == {s.name: d for s, d in gen}
    with StoreClient(store.target, TOKENS["acme"], timeout_s=2) as c:
        with pytest.raises(Unavailable):
            c.manifest(key)


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _pki(d, san: str):
    """A test CA in `d` (ca.pem) and a server and a client certificate it signed (server.pem/.key,
    client.pem/.key), both for the subjectAltName `san`."""
    d.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=redknot-test-ca", cwd=d)
    (d / "san.cnf").write_text(f"subjectAltName={san}\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", "san.cnf", cwd=d)
    return d


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_mtls(store_factory, tmp_path):
    """With --tls-client-ca the store accepts only clients whose certificate that CA signed."""
    d = _pki(tmp_path / "pki", "DNS:localhost,IP:127.0.0.1")
    store = store_factory(extra_args=["--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"),
                                      "--tls-client-ca", str(d / "ca.pem")])
    store.wait_serving = lambda timeout=30: None        # the plaintext health probe cannot talk TLS
    store.start()
    ca, cert, k = ((d / n).read_bytes() for n in ("ca.pem", "client.pem", "client.key"))
    key = doc_key("mtls", tp_size=1)
    deadline = time.monotonic() + 30
    with StoreClient(store.target, TOKENS["acme"], tls=TlsConfig(ca, cert, k, server_name="localhost")) as c:
        while True:
            try:
                c.put_generation(key, make_generation(key, layers=1, size=100))
                break
            except Unavailable:
                assert time.monotonic() < deadline, store.log()[-2000:]
                time.sleep(0.2)
        assert c.manifest(key).current_generation == 1
    with StoreClient(store.target, TOKENS["acme"], tls=TlsConfig(ca, server_name="localhost"), timeout_s=5) as c:
        with pytest.raises(Unavailable):            # no client certificate: the handshake fails
            c.manifest(key)
    with grpc.insecure_channel(store.target) as ch:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(ch).result(timeout=2)


def test_a_blob_claimed_by_gc_is_neither_deduplicated_nor_written_nor_committed(store, client, redis_url):
    """While GC holds a digest (between claiming and deleting its blob), Begin does not count it as stored,
    a put of it and a commit naming it are refused with UNAVAILABLE; once released, all of them go through."""
    key = doc_key("claimed", tp_size=1)
    gen = make_generation(key, layers=1, size=256)
    client.put_generation(key, gen)
    victim, data = next((s, d) for s, d in gen if s.kind is ShardKind.LATENT)
    claimed = f"{store.prefix}:{{acme/{key.doc_id}}}:deleting"
    r = sync_client(redis_url)          # a plain or a cluster URL (test_redis_cluster.py runs this too)
    r.sadd(claimed, victim.digest)                      # what GC's mark script does
    b = client.begin(key, [s for s, _ in gen])
    assert victim.ref not in b.already_stored and len(b.already_stored) == len(gen) - 1
    with pytest.raises(Unavailable):
        client.put(b.upload_id, [(victim, data)])
    r.srem(claimed, victim.digest)
    client.put(b.upload_id, [(victim, data)])
    r.sadd(claimed, victim.digest)
    with pytest.raises(Unavailable):
        client.commit(b.upload_id)
    r.srem(claimed, victim.digest)
    assert client.commit(b.upload_id).manifest.generation == 2


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_the_services_reach_a_tls_store_through_their_settings(store_factory, tmp_path):
    """The API, builder and workers talk to a store that requires mTLS through CommonSettings.store_tls_* (before,
    no service could use the store's TLS): the worker's prefetcher fetches a generation with them, and the same
    settings without the client certificate are refused."""
    from services.common.settings import CommonSettings
    from services.common.tenants import Tenants
    from services.worker.prefetch import Prefetcher
    from services.worker.tier import PinnedTier
    d = _pki(tmp_path / "pki", "DNS:store.internal")
    store = store_factory(extra_args=["--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"),
                                      "--tls-client-ca", str(d / "ca.pem")])
    store.wait_serving = lambda timeout=30: None        # the plaintext health probe cannot talk TLS
    store.start()
    s = CommonSettings(store=store.target, store_tls_ca=str(d / "ca.pem"), store_tls_cert=str(d / "client.pem"),
                       store_tls_key=str(d / "client.key"), store_tls_server_name="store.internal")
    tls = s.store_tls()
    key = doc_key("tls-settings", tp_size=1)
    gen = make_generation(key, layers=2, size=100)
    deadline = time.monotonic() + 30
    with StoreClient(store.target, TOKENS["acme"], tls=tls) as c:
        while True:
            try:
                c.put_generation(key, gen)
                break
            except Unavailable:
                assert time.monotonic() < deadline, store.log()[-2000:]
                time.sleep(0.2)
    pf = Prefetcher(PinnedTier(0), Tenants(TOKENS), s.store, rank=0, channels=(0, 64), n_layers=2, layer_group=1,
                    threads=2, tls=tls)
    try:
        src = pf.open("acme", key, 1).source
        got = {**src.head.result(timeout=30), **{n: b for _, f in src.groups for n, b in f.result(timeout=30).items()}}
        assert got == {sp.name: data for sp, data in gen if sp.rank == 0}
    finally:
        pf.close()
    no_cert = CommonSettings(store=store.target, store_tls_ca=str(d / "ca.pem"),
                             store_tls_server_name="store.internal").store_tls()
    with StoreClient(store.target, TOKENS["acme"], tls=no_cert, timeout_s=5) as c:
        with pytest.raises(Unavailable):            # mTLS: no client certificate, no handshake
            c.manifest(key)
    with pytest.raises(ValueError):
        CommonSettings(store_tls_ca=str(d / "ca.pem"), store_tls_cert=str(d / "client.pem"))   # a cert without key
    with pytest.raises(ValueError):
        CommonSettings(store_tls_cert=str(d / "client.pem"), store_tls_key=str(d / "client.key"))  # no CA
