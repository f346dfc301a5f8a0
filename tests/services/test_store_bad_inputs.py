"""Malformed requests get a clear error (INVALID_ARGUMENT, or the fitting code) and change nothing: the Redis
index and the blob directory are byte-for-byte the same before and after each one."""
from __future__ import annotations

import dataclasses
import json

import grpc
import pytest
import redis

from services.store.calibration import MAX_RECORD_BYTES, CalibrationKey
from services.store.errors import (DataLoss, FailedPrecondition, InvalidArgument, LimitExceeded, NotFound,
                                   PermissionDenied, StoreError, Unauthenticated)
from services.store.keys import CHUNK_BYTES, DocumentKey, Range, ShardKind, ShardSpec, digest_bytes
from services.store.pb import artifact_store_pb2 as pb

from .conftest import TOKENS, doc_key, make_generation

SERVICE = "/redknot.store.v1.ArtifactStoreService/"
CALIBRATION = {"version": 1, "fingerprint": digest_bytes(b"checkpoint"), "profile": {"name": "demo"}, "passed": True}
LIMITS = ["--max-shard-bytes", str(8 << 20), "--max-shards-per-generation", "64"]


def snapshot(redis_url: str, prefix: str, root) -> dict:
    r = redis.Redis.from_url(redis_url)
    state = {}
    for k in sorted(r.scan_iter(match=f"{prefix}:*", count=1000)):
        t = r.type(k).decode()
        state[k] = {"string": lambda: r.get(k), "hash": lambda: r.hgetall(k), "set": lambda: r.smembers(k),
                    "zset": lambda: r.zrange(k, 0, -1, withscores=True)}[t]()
    files = sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file())
    return {"redis": state, "files": files}


@pytest.fixture(scope="module")
def env(tmp_path_factory, redis_url):
    import uuid
    from .conftest import StoreProcess, _cleanup_prefix
    prefix = f"rktest-{uuid.uuid4().hex[:10]}"
    proc = StoreProcess(tmp_path_factory.mktemp("bad"), redis_url, prefix, extra_args=LIMITS,
                        extra_env={"REDKNOT_STORE_ADMIN_TENANTS": "acme"}).start()
    c = proc.client()
    key = doc_key("bad-inputs")
    c.put_generation(key, make_generation(key, tag="committed"))      # something that must stay intact
    c.put_calibration(json.dumps(CALIBRATION).encode())              # and a calibration record
    yield proc, c, key
    c.close()
    proc.kill()
    _cleanup_prefix(redis_url, prefix)


@pytest.fixture
def unchanged(env, redis_url, request):
    """The index and blobs byte-identical after the test's rejected calls; counted in the fault suite's summary
    (tests/conftest.py)."""
    proc, _, _ = env
    before = snapshot(redis_url, proc.prefix, proc.blob_root)
    yield
    same = snapshot(redis_url, proc.prefix, proc.blob_root) == before
    request.node.user_properties.append(("fault_counts", ("bad gRPC inputs (store)", {
        "cases": 1, "state changes": int(not same)})))
    assert same, "a rejected request changed state"


def raw_call(proc, method: str, payload: bytes, token: str = TOKENS["acme"]):
    with grpc.insecure_channel(proc.target) as ch:
        fn = ch.unary_unary(SERVICE + method)
        with pytest.raises(grpc.RpcError) as e:
            fn(payload, metadata=(("authorization", f"Bearer {token}"),), timeout=10)
    return e.value.code(), e.value.details()


def spec(name="certificate.msgpack", rank=0, kind=ShardKind.CERTIFICATE, data=b"x" * 10, layers=Range(),
         channels=Range(), size=None, digest=None):
    return ShardSpec(name, rank, kind, digest or digest_bytes(data), len(data) if size is None else size, layers,
                     channels)


def valid_table(key: DocumentKey) -> list[ShardSpec]:
    return [spec(rank=r, data=f"cert{r}".encode()) for r in range(key.tp_size)]


# --------------------------------------------------------------------------------------------- wire level

@pytest.mark.parametrize("method", ["BeginGeneration", "CommitGeneration", "GetManifest", "FetchShards",
                                    "ValidateCertificate", "ListDocuments", "RetireGeneration", "CollectGarbage",
                                    "PutCalibration", "GetCalibration"])
def test_bytes_that_are_not_the_message(env, unchanged, method):
    proc, _, _ = env
    if method == "FetchShards":
        with grpc.insecure_channel(proc.target) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(ch.unary_stream(SERVICE + method)(b"\xff\xff\xff\xff", metadata=(
                    ("authorization", f"Bearer {TOKENS['acme']}"),), timeout=10))
        code = e.value.code()
    else:
        code, _ = raw_call(proc, method, b"\xff\xff\xff\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_wrong_wire_types(env, unchanged):
    proc, _, _ = env
    # field 1 (key, a message) sent as a varint, field 4 of the key (tp_size, int64) as a string
    code, _ = raw_call(proc, "BeginGeneration", b"\x08\x01")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    bad_key = pb.DocumentKey(doc_hash="a" * 64).SerializeToString() + b"\x22\x03abc"
    code, _ = raw_call(proc, "GetManifest", b"\x0a" + bytes([len(bad_key)]) + bad_key)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


# ------------------------------------------------------------------------------------------------- begin

def _replace(s: ShardSpec, **kw) -> ShardSpec:
    return dataclasses.replace(s, **kw)


BAD_TABLES = {
    "no shards (commit without shards)": lambda k: [],
    "name ../escape": lambda k: valid_table(k) + [spec("../escape", kind=ShardKind.OTHER)],
    "name a/b": lambda k: valid_table(k) + [spec("a/b", kind=ShardKind.OTHER)],
    "name .hidden": lambda k: valid_table(k) + [spec(".hidden", kind=ShardKind.OTHER)],
    "name a..b": lambda k: valid_table(k) + [spec("a..b", kind=ShardKind.OTHER)],
    "name with NUL": lambda k: valid_table(k) + [spec("a\0b", kind=ShardKind.OTHER)],
    "negative channel lo": lambda k: valid_table(k) + [spec("l", kind=ShardKind.LOCAL, layers=Range(0, 1),
                                                            channels=Range(-1, 4))],
    "reversed channels": lambda k: valid_table(k) + [spec("l", kind=ShardKind.LOCAL, layers=Range(0, 1),
                                                          channels=Range(8, 4))],
    "empty channels on LOCAL": lambda k: valid_table(k) + [spec("l", kind=ShardKind.LOCAL, layers=Range(0, 1))],
    "channels on a latent": lambda k: valid_table(k) + [spec("l", kind=ShardKind.LATENT, layers=Range(0, 1),
                                                             channels=Range(0, 4))],
    "overlapping channels": lambda k: valid_table(k) + [
        spec("a", kind=ShardKind.LOCAL, layers=Range(0, 1), channels=Range(0, 64)),
        spec("b", kind=ShardKind.LOCAL, layers=Range(0, 1), channels=Range(32, 96))],
    "negative layers": lambda k: valid_table(k) + [spec("l", kind=ShardKind.LATENT, layers=Range(-2, 1))],
    "negative rank": lambda k: valid_table(k) + [spec("x", rank=-1, kind=ShardKind.OTHER)],
    "rank >= tp_size": lambda k: valid_table(k) + [spec("x", rank=k.tp_size, kind=ShardKind.OTHER)],
    "negative size": lambda k: valid_table(k) + [spec("x", kind=ShardKind.OTHER, size=-5)],
    "digest not hex": lambda k: valid_table(k) + [spec("x", kind=ShardKind.OTHER, digest="../" * 21 + "a")],
    "digest upper case": lambda k: valid_table(k) + [spec("x", kind=ShardKind.OTHER, digest="A" * 64)],
    "duplicate name": lambda k: valid_table(k) + [spec("x", kind=ShardKind.OTHER)] * 2,
    "rank without certificate": lambda k: valid_table(k)[:1],
    "two certificates": lambda k: valid_table(k) + [spec("cert2", rank=0)],
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_bad_shard_tables(env, unchanged, case):
    _, c, key = env
    with pytest.raises(InvalidArgument):
        c.begin(key, BAD_TABLES[case](key))


def test_unset_kind(env, unchanged):
    proc, _, key = env
    from services.store import wire
    req = pb.BeginGenerationRequest(key=wire.key_to_pb(key), shards=[wire.shard_to_pb(s) for s in valid_table(key)])
    req.shards.add(name="x", rank=0, digest="a" * 64, size=1)          # kind left UNSPECIFIED
    code, details = raw_call(proc, "BeginGeneration", req.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    req.shards[-1].kind = 99                                            # not a ShardKind at all
    code, details = raw_call(proc, "BeginGeneration", req.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details


@pytest.mark.parametrize("field,value", [("doc_hash", ""), ("doc_hash", "../../etc/passwd"),
                                         ("checkpoint_fingerprint", "x" * 64), ("profile", "../flash"),
                                         ("profile", "a/b"), ("profile", ""), ("tp_size", 0), ("tp_size", -2)])
def test_bad_document_keys(env, unchanged, field, value):
    _, c, key = env
    bad = dataclasses.replace(key, **{field: value})
    with pytest.raises(InvalidArgument):
        c.begin(bad, valid_table(key))
    with pytest.raises(InvalidArgument):
        c.manifest(bad)
    with pytest.raises(InvalidArgument):
        list(c.fetch(bad, 0))


def test_limits(env, unchanged):
    _, c, key = env
    with pytest.raises(LimitExceeded):
        c.begin(key, valid_table(key) + [spec("big", kind=ShardKind.OTHER, size=(8 << 20) + 1)])
    many = valid_table(key) + [spec(f"s{i}", kind=ShardKind.OTHER) for i in range(63)]
    with pytest.raises(LimitExceeded):
        c.begin(key, many)


def test_committed_generation_is_immutable(env, unchanged):
    _, c, key = env
    from services.store.errors import AlreadyExists
    with pytest.raises(AlreadyExists):
        c.begin(key, valid_table(key), generation=1)


# -------------------------------------------------------------------------------------------------- puts

@pytest.fixture
def upload(env):
    """A fresh upload of one 3-byte-declared OTHER shard plus certificates; the snapshot is taken after it."""
    import uuid
    _, c, _ = env
    key = doc_key(f"bad-puts-{uuid.uuid4().hex}")       # fresh document: nothing deduplicated
    data = b"abcdefgh"
    table = valid_table(key) + [spec("payload.bin", kind=ShardKind.OTHER, data=data)]
    b = c.begin(key, table)
    assert b.already_stored == ()
    return b.upload_id, data, key


def put_raw(proc, messages, token=TOKENS["acme"]):
    with grpc.insecure_channel(proc.target, options=[("grpc.max_send_message_length", 16 << 20)]) as ch:
        fn = ch.stream_unary(SERVICE + "PutShards", request_serializer=pb.PutShardsRequest.SerializeToString,
                             response_deserializer=pb.PutShardsResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            fn(iter(messages), metadata=(("authorization", f"Bearer {token}"),), timeout=20)
    return e.value.code(), e.value.details()


def M(upload_id, offset, data, last=False, name="payload.bin", rank=0):
    return pb.PutShardsRequest(upload_id=upload_id, rank=rank, name=name, offset=offset, data=data, last=last)


PUT_CASES = {
    "out of order": (lambda u, d: [M(u, 0, d[:3]), M(u, 5, d[5:], last=True)], grpc.StatusCode.INVALID_ARGUMENT),
    "first chunk not at 0": (lambda u, d: [M(u, 2, d[2:], last=True)], grpc.StatusCode.INVALID_ARGUMENT),
    "repeated chunk": (lambda u, d: [M(u, 0, d[:4]), M(u, 0, d[:4])], grpc.StatusCode.INVALID_ARGUMENT),
    "more than declared": (lambda u, d: [M(u, 0, d + b"!", last=True)], grpc.StatusCode.INVALID_ARGUMENT),
    "last too early": (lambda u, d: [M(u, 0, d[:4], last=True)], grpc.StatusCode.INVALID_ARGUMENT),
    "stream ends inside shard": (lambda u, d: [M(u, 0, d[:4])], grpc.StatusCode.INVALID_ARGUMENT),
    "undeclared shard": (lambda u, d: [M(u, 0, d, True, name="other.bin")], grpc.StatusCode.INVALID_ARGUMENT),
    "path-like shard name": (lambda u, d: [M(u, 0, d, True, name="../payload.bin")], grpc.StatusCode.INVALID_ARGUMENT),
    "wrong rank": (lambda u, d: [M(u, 0, d, True, rank=1)], grpc.StatusCode.INVALID_ARGUMENT),
    "path-like upload id": (lambda u, d: [M("../../" + u, 0, d, True)], grpc.StatusCode.INVALID_ARGUMENT),
    "unknown upload id": (lambda u, d: [M("0" * 32 + "." + "1" * 32, 0, d, True)], grpc.StatusCode.NOT_FOUND),
    "two uploads in one stream": (lambda u, d: [M(u, 0, d[:2]), M("0" * 32 + "." + "1" * 32, 2, d[2:], True)],
                                  grpc.StatusCode.INVALID_ARGUMENT),
    "oversized chunk": (lambda u, d: [M(u, 0, b"z" * (CHUNK_BYTES + 1))], grpc.StatusCode.INVALID_ARGUMENT),
    "message over the gRPC limit": (lambda u, d: [M(u, 0, b"z" * (5 << 20))], grpc.StatusCode.RESOURCE_EXHAUSTED),
    "empty stream": (lambda u, d: [], grpc.StatusCode.INVALID_ARGUMENT),
    "bytes that do not hash to the digest": (lambda u, d: [M(u, 0, d[::-1], last=True)], grpc.StatusCode.DATA_LOSS),
}


@pytest.mark.parametrize("case", sorted(PUT_CASES))
def test_bad_puts(env, upload, redis_url, case):
    proc, c, _ = env
    upload_id, data, key = upload
    before = snapshot(redis_url, proc.prefix, proc.blob_root)
    failures = proc.metric("redknot_store_digest_failures_total", 'stage="write"')
    build, want = PUT_CASES[case]
    code, details = put_raw(proc, build(upload_id, data))
    assert code == want, (code, details)
    assert snapshot(redis_url, proc.prefix, proc.blob_root) == before, "a rejected put changed state"
    moved = proc.metric("redknot_store_digest_failures_total", 'stage="write"') - failures
    assert moved == (1 if want == grpc.StatusCode.DATA_LOSS else 0)
    # the upload is still usable: the correct bytes go in and the generation commits
    c.put(upload_id, [(spec("payload.bin", kind=ShardKind.OTHER, data=data), data)] +
          [(spec(rank=r, data=f"cert{r}".encode()), f"cert{r}".encode()) for r in range(key.tp_size)])
    assert c.commit(upload_id).manifest.generation >= 1


# ------------------------------------------------------------------------------------------ commit, auth

def test_commit_before_the_shards_changes_nothing(env, upload, redis_url):
    proc, c, _ = env
    upload_id, _, key = upload
    before = snapshot(redis_url, proc.prefix, proc.blob_root)
    with pytest.raises(FailedPrecondition):
        c.commit(upload_id)
    assert snapshot(redis_url, proc.prefix, proc.blob_root) == before
    with pytest.raises(NotFound):
        c.manifest(key)


@pytest.mark.parametrize("upload_id", ["", "../x", "a" * 65, "0" * 32 + "/" + "1" * 32])
def test_commit_of_malformed_upload_ids(env, unchanged, upload_id):
    _, c, _ = env
    with pytest.raises(InvalidArgument):
        c.commit(upload_id)


@pytest.mark.parametrize("auth", [None, "Bearer nope-not-a-token-at-all", f"Basic {TOKENS['acme']}", "Bearer ",
                                  f"bearer{TOKENS['acme']}"])
def test_unknown_tenant(env, unchanged, auth):
    proc, _, key = env
    from services.store import wire
    md = (("authorization", auth),) if auth is not None else ()
    with grpc.insecure_channel(proc.target) as ch:
        from services.store.pb import artifact_store_pb2_grpc as pb_grpc
        stub = pb_grpc.ArtifactStoreServiceStub(ch)
        for call in (lambda: stub.GetManifest(pb.GetManifestRequest(key=wire.key_to_pb(key)), metadata=md, timeout=5),
                     lambda: stub.BeginGeneration(pb.BeginGenerationRequest(
                         key=wire.key_to_pb(key), shards=[wire.shard_to_pb(s) for s in valid_table(key)]),
                         metadata=md, timeout=5),
                     lambda: list(stub.FetchShards(pb.FetchShardsRequest(key=wire.key_to_pb(key)), metadata=md,
                                                   timeout=5)),
                     lambda: stub.ListDocuments(pb.ListDocumentsRequest(), metadata=md, timeout=5),
                     lambda: stub.PutCalibration(pb.PutCalibrationRequest(record=json.dumps(CALIBRATION).encode()),
                                                 metadata=md, timeout=5),
                     lambda: stub.GetCalibration(pb.GetCalibrationRequest(), metadata=md, timeout=5)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ------------------------------------------------------------------------------------------------ reads

def test_bad_read_requests(env, unchanged):
    _, c, key = env
    for call in (lambda: list(c.fetch(key, -1)), lambda: list(c.fetch(key, key.tp_size)),
                 lambda: list(c.fetch(key, 0, layers=Range(3, 1))),
                 lambda: list(c.fetch(key, 0, channels=Range(-4, 1))),
                 lambda: c.validate(key, -1), lambda: c.validate(key, 0, layers_needed=[-1]),
                 lambda: c.validate(key, 0, certificate_digest="../" * 10),
                 lambda: c.retire(key, 0), lambda: c.list_documents(page_size=-1),
                 lambda: c.list_documents(doc_hash="../x")):
        with pytest.raises(InvalidArgument):
            call()
    with pytest.raises(InvalidArgument):
        c._call(c.stub.ListDocuments, pb.ListDocumentsRequest(page_token="not-a-cursor"))
    with pytest.raises(NotFound):
        c.manifest(key, generation=99)
    assert isinstance(DataLoss("x"), StoreError) and isinstance(Unauthenticated("x"), StoreError)


# ----------------------------------------------------------------------------------- calibration records

BAD_RECORDS = {
    "empty": (b"", "not UTF-8 JSON"),
    "not UTF-8": (b"\xff\xfe{}", "not UTF-8 JSON"),
    "not JSON": (b"{not json", "not UTF-8 JSON"),
    "a JSON array": (b"[1, 2]", "a JSON list, not an object"),
    "a JSON string": (b'"fingerprint"', "a JSON str, not an object"),
    "no fingerprint": (json.dumps({k: v for k, v in CALIBRATION.items() if k != "fingerprint"}).encode(),
                       "has no fingerprint"),
    "fingerprint not hex": (json.dumps(dict(CALIBRATION, fingerprint="../" * 21 + "a")).encode(),
                            "fingerprint .* is not a blake3 hex digest"),
    "fingerprint upper case": (json.dumps(dict(CALIBRATION, fingerprint="A" * 64)).encode(), "not a blake3 hex"),
    "fingerprint a number": (json.dumps(dict(CALIBRATION, fingerprint=7)).encode(), "not a blake3 hex"),
    "no profile": (json.dumps({k: v for k, v in CALIBRATION.items() if k != "profile"}).encode(),
                   "has no profile object"),
    "profile a string": (json.dumps(dict(CALIBRATION, profile="demo")).encode(), "has no profile object"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_bad_calibration_records_are_refused_and_store_nothing(env, unchanged, case):
    _, c, _ = env
    raw, why = BAD_RECORDS[case]
    with pytest.raises(InvalidArgument, match=why):
        c.put_calibration(raw)


def test_a_calibration_record_too_large_or_from_a_non_admin_is_refused(env, unchanged):
    proc, c, _ = env
    big = json.dumps(dict(CALIBRATION, padding="x" * MAX_RECORD_BYTES)).encode()
    with pytest.raises(LimitExceeded, match=f"at most {MAX_RECORD_BYTES}"):
        c.put_calibration(big)
    code, details = raw_call(proc, "PutCalibration", pb.PutCalibrationRequest(record=big).SerializeToString())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "calibration record of" in details
    with proc.client("globex") as globex, pytest.raises(PermissionDenied, match="admin tenants"):
        globex.put_calibration(json.dumps(dict(CALIBRATION, passed=False)).encode())


def test_bad_calibration_keys(env, unchanged):
    _, c, _ = env
    fp = CALIBRATION["fingerprint"]
    for k in (CalibrationKey("", "demo-0123456789abcdef"), CalibrationKey("A" * 64, "demo-0123456789abcdef"),
              CalibrationKey(fp, ""), CalibrationKey(fp, "../x"), CalibrationKey(fp, "a/b")):
        with pytest.raises(InvalidArgument):
            c.get_calibration(k)
