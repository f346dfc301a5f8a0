"""The local socket (`--local-socket`): a real store process hands a co-located client open blob descriptors.
It answers exactly what FetchShards answers, keeps tenants apart, never lets a corrupt or truncated blob
through, refuses malformed frames without changing anything, and goes away cleanly with the server."""
from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

import msgpack
import pytest

from services.store import local_wire
from services.store.core import FetchParams
from services.store.errors import (DataLoss, InvalidArgument, LimitExceeded, NoLocalStore, NotFound, Unauthenticated,
                                   Unavailable)
from services.store.local_client import LocalStoreClient
from services.store.keys import Range, ShardKind

from .conftest import TOKENS, doc_key, make_generation
from .test_store_bad_inputs import snapshot

READ_FAILURES = ("redknot_store_digest_failures_total", 'stage="read"')


@pytest.fixture
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="rk-", dir="/tmp"))      # a Unix socket path must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def local_store(store_factory, sock_dir):
    path = sock_dir / "store.sock"
    proc = store_factory(extra_args=["--local-socket", str(path)],
                         extra_env={"REDKNOT_STORE_LOCAL_SOCKET_TIMEOUT_S": "2"}).start()
    proc.socket_path = path
    return proc


def local(proc, tenant: str = "acme", **kw) -> LocalStoreClient:
    return LocalStoreClient(proc.socket_path, TOKENS[tenant], timeout_s=10, **kw)


def as_dict(shards) -> dict:
    return {s.spec.name: (s.spec, s.generation, bytes(s.data)) for s in shards}


def raw_exchange(path: Path, frame: bytes) -> dict:
    with local_wire.new_socket() as s:
        s.settimeout(10)
        s.connect(str(path))
        s.send(frame)
        raw, fds, _, _ = socket.recv_fds(s, local_wire.MAX_FRAME + 1, local_wire.BATCH)
        for fd in fds:
            os.close(fd)
        return msgpack.unpackb(raw)


def test_local_fetch_equals_grpc_fetch_byte_for_byte(local_store):
    key = doc_key("local-roundtrip")
    # 17 layers: 36 shards per rank, more than one reply frame (32 descriptors each)
    gen = make_generation(key, layers=17, size=256 << 10)
    with local_store.client() as grpc_client, local(local_store, threads=1) as lc, \
            local(local_store, threads=4) as pooled, local(local_store, threads=3, parallel_hash=False) as plain, \
            local_store.client(local_socket=local_store.socket_path) as both:
        grpc_client.put_generation(key, gen)
        grpc_client.put_generation(key, make_generation(key, layers=17, size=256 << 10, tag="second"))
        selections = [dict(), dict(layers=Range(1, 3)), dict(channels=Range(64, 128)), dict(generation=1),
                      dict(names=["certificate.msgpack", "layer07.latent.safetensors"]),
                      dict(layers=Range(5, 6), channels=Range(0, 64))]
        for rank in range(key.tp_size):
            for sel in selections:
                want = as_dict(grpc_client.fetch(key, rank, **sel))
                assert want, sel
                for c in (lc, pooled, plain, both):
                    assert as_dict(c.fetch(key, rank, **sel)) == want, (rank, sel, c)
        assert {s.spec.name: bytes(s.data) for s in lc.fetch(key, 0, generation=1)} == \
            {s.name: d for s, d in gen if s.rank == 0}
        bytes_before = local_store.metric("redknot_store_bytes_out_total", 'path="local"')
        shards_before = local_store.metric("redknot_store_shards_served_total", 'path="local"')
        got = list(lc.fetch(key, 1, layers=Range(0, 4)))
        assert local_store.metric("redknot_store_bytes_out_total", 'path="local"') == \
            bytes_before + sum(s.spec.size for s in got)
        assert local_store.metric("redknot_store_shards_served_total", 'path="local"') == shards_before + len(got)
        assert local_store.metric("redknot_store_rpcs_total", 'code="OK",method="LocalFetchShards"') > 0
        with pytest.raises(NotFound) as local_err:
            list(lc.fetch(key, 0, names=["nope.bin"]))
        with pytest.raises(NotFound) as grpc_err:
            list(grpc_client.fetch(key, 0, names=["nope.bin"]))
        assert str(local_err.value) == str(grpc_err.value)


def test_another_tenant_learns_nothing(local_store):
    key = doc_key("local-tenants")
    with local_store.client() as acme:
        acme.put_generation(key, make_generation(key))
    with local(local_store, "globex") as lc, local_store.client("globex") as grpc_globex:
        with pytest.raises(NotFound) as local_err:
            list(lc.fetch(key, 0))
        with pytest.raises(NotFound) as grpc_err:
            list(grpc_globex.fetch(key, 0))
        with pytest.raises(NotFound) as absent_err:       # a document nobody uploaded reads the same
            list(lc.fetch(doc_key("local-never-uploaded"), 0))
        assert str(local_err.value) == str(grpc_err.value) == str(absent_err.value)
        # a report about acme's shard is resolved as globex's selection: the same NotFound, no counter moves
        before = local_store.metric(*READ_FAILURES)
        d = raw_exchange(local_store.socket_path, local_wire.request_bytes(
            "report", TOKENS["globex"], FetchParams(key, 1, 0, names=("certificate.msgpack",))))
        with pytest.raises(NotFound) as grpc_g1:
            list(grpc_globex.fetch(key, 0, generation=1))
        assert d["error"] == "NotFound" and d["detail"] == str(grpc_g1.value)
        assert local_store.metric(*READ_FAILURES) == before


def _blob(proc, spec) -> Path:
    return next((proc.blob_root / "blobs").rglob(spec.digest))


def test_corrupt_truncated_and_missing_blobs_are_data_loss_and_counted(local_store):
    key = doc_key("local-corrupt")
    gen = make_generation(key, size=3 << 20)
    victim = next(s for s, _ in gen if s.rank == 0 and s.kind is ShardKind.LATENT)
    with local_store.client() as c, local(local_store) as lc:
        c.put_generation(key, gen)
        path = _blob(local_store, victim)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 3] ^= 0x40
        with open(path, "r+b") as f:                # same size, one bit flipped, in place
            f.write(raw)
        before = local_store.metric(*READ_FAILURES)
        with pytest.raises(DataLoss, match="the store confirmed it"):
            list(lc.fetch(key, 0))
        assert local_store.metric(*READ_FAILURES) == before + 1
        with local(local_store, threads=3) as pooled, pytest.raises(DataLoss, match="the store confirmed it"):
            list(pooled.fetch(key, 0))
        assert local_store.metric(*READ_FAILURES) == before + 2
        before += 1
        others = [s.name for s, _ in gen if s.rank == 0 and s.name != victim.name]
        assert {s.spec.name for s in lc.fetch(key, 0, names=others)} == set(others)     # the rest still serves
        # a false report (an intact shard) is checked by the store and moves nothing
        d = raw_exchange(local_store.socket_path, local_wire.request_bytes(
            "report", TOKENS["acme"], FetchParams(key, 1, 0, names=(others[0],))))
        assert d == {"confirmed": False}
        assert local_store.metric(*READ_FAILURES) == before + 1

        path.write_bytes(bytes(raw[:-1]))             # truncated: refused by the store's size check
        with pytest.raises(DataLoss, match="holds"):
            list(lc.fetch(key, 0, names=[victim.name]))
        assert local_store.metric(*READ_FAILURES) == before + 2
        path.unlink()
        with pytest.raises(DataLoss, match="missing"):
            list(lc.fetch(key, 0, names=[victim.name]))
        assert local_store.metric(*READ_FAILURES) == before + 3
        c.put_generation(key, gen)                  # a fresh upload repairs it, as over gRPC
        assert {s.spec.name: bytes(s.data) for s in lc.fetch(key, 0)} == {s.name: d for s, d in gen if s.rank == 0}


def test_bad_frames_get_clear_errors_change_nothing_and_the_server_keeps_serving(local_store, redis_url):
    key = doc_key("local-bad")
    with local_store.client() as c:
        c.put_generation(key, make_generation(key))
    good = local_wire.request_bytes("fetch", TOKENS["acme"], FetchParams(key, 0, 0, names=("manifest.msgpack",)))
    ok = dict(v=1, op="fetch", token=TOKENS["acme"], key=[key.doc_hash, key.checkpoint_fingerprint, key.profile,
                                                             key.tp_size], generation=0, rank=0, layers=None,
              channels=None, names=[])
    bad = {
        b"\xc1 not msgpack": ("InvalidArgument", "not msgpack"),
        msgpack.packb([1, 2, 3]): ("InvalidArgument", "not a map"),
        msgpack.packb(dict(ok, v=2)): ("InvalidArgument", "protocol version"),
        msgpack.packb(dict(ok, op="delete")): ("InvalidArgument", "op"),
        msgpack.packb(dict(ok, token="not-a-tenant-token-at-all")): ("Unauthenticated", "bearer token"),
        msgpack.packb(dict(ok, token=None)): ("InvalidArgument", "token"),
        msgpack.packb(dict(ok, key=[key.doc_hash, key.checkpoint_fingerprint, "../../etc", 2])):
            ("InvalidArgument", "profile"),
        msgpack.packb(dict(ok, rank=7)): ("InvalidArgument", "outside tp_size"),
        msgpack.packb(dict(ok, rank="0")): ("InvalidArgument", "not an integer"),
        msgpack.packb(dict(ok, channels=[64, 0])): ("InvalidArgument", "channels"),
        msgpack.packb(dict(ok, layers=[1, 2, 3])): ("InvalidArgument", "range"),
        msgpack.packb(dict(ok, names="manifest.msgpack")): ("InvalidArgument", "names"),
        msgpack.packb(dict(ok, op="report", generation=0, names=["manifest.msgpack"])): ("InvalidArgument",
                                                                                           "one shard"),
        b"\x00" * (local_wire.MAX_FRAME + 1000): ("LimitExceeded", "frame of more than"),
    }
    before = snapshot(redis_url, local_store.prefix, local_store.blob_root)
    with local_wire.new_socket() as s:                # one connection: each error leaves it usable
        s.settimeout(10)
        s.connect(str(local_store.socket_path))
        for frame, (error, text) in bad.items():
            s.send(frame)
            raw, fds, _, _ = socket.recv_fds(s, local_wire.MAX_FRAME + 1, local_wire.BATCH)
            d = msgpack.unpackb(raw)
            assert fds == [] and d["error"] == error and text in d["detail"], (frame[:40], d)
        s.send(good)
        raw, fds, _, _ = socket.recv_fds(s, local_wire.MAX_FRAME + 1, local_wire.BATCH)
        d = msgpack.unpackb(raw)
        assert len(fds) == 1 and d["last"] and d["shards"][0][0] == "manifest.msgpack", d
        for fd in fds:
            os.close(fd)
    assert snapshot(redis_url, local_store.prefix, local_store.blob_root) == before
    # the client raises the domain errors the gRPC client raises
    with LocalStoreClient(local_store.socket_path, "not-a-tenant-token-at-all") as lc, pytest.raises(Unauthenticated):
        list(lc.fetch(key, 0))
    with local(local_store) as lc:
        with pytest.raises(InvalidArgument):
            list(lc.fetch(key, 0, channels=Range(5, 1)))
        with pytest.raises(LimitExceeded):
            list(lc.fetch(key, 0, names=[f"n{i:05d}.bin" for i in range(8000)]))
    # a client that connects and says nothing is dropped after the timeout (2 s here); others are served meanwhile
    with local_wire.new_socket() as idle:
        idle.settimeout(10)
        idle.connect(str(local_store.socket_path))
        t = time.monotonic()
        with local(local_store) as lc:
            assert [s.spec.name for s in lc.fetch(key, 0, names=["manifest.msgpack"])] == ["manifest.msgpack"]
        assert idle.recv(16) == b"" and 1.5 < time.monotonic() - t < 8
    assert local_store.metric("redknot_store_rpcs_total", 'code="INVALID_ARGUMENT",method="LocalFetchShards"') >= 10


def test_socket_mode_and_clean_shutdown(store_factory, sock_dir):
    path = sock_dir / "store.sock"
    proc = store_factory(extra_args=["--local-socket", str(path)]).start()
    assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
    key = doc_key("local-stop")
    with proc.client() as c, LocalStoreClient(path, TOKENS["acme"]) as lc:
        c.put_generation(key, make_generation(key))
        assert len(list(lc.fetch(key, 1))) == 8
        proc.kill()                                  # SIGKILL leaves the socket file behind
        assert path.exists()
        with pytest.raises(Unavailable):
            list(lc.fetch(key, 1))
        # a restart replaces the stale socket file; the group mode is applied as asked
        proc = store_factory(extra_args=["--local-socket", str(path)],
                             extra_env={"REDKNOT_STORE_LOCAL_SOCKET_MODE": "0660"}).start()
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        assert len(list(lc.fetch(key, 1))) == 8
        assert proc.terminate() == 0
        assert not path.exists()
        assert "redknot store: stopped" in proc.log()


def test_local_socket_needs_the_fs_backend():
    from services.store.settings import Settings
    with pytest.raises(ValueError, match="fs backend"):
        Settings(backend="s3", local_socket="/tmp/x.sock")
    with pytest.raises(ValueError, match="0600 or 0660"):
        Settings(local_socket="/tmp/x.sock", local_socket_mode="0666")


def test_a_socket_no_store_listens_on_means_grpc(local_store, sock_dir):
    """A worker set to use the local socket on a node where the store does not run (no socket file, or a stale one
    nothing accepts on) fetches the same bytes over gRPC and says so once; the local path alone names the cause."""
    key = doc_key("local-absent")
    stale = sock_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:            # bound, then closed: a socket file nothing listens on
        s.bind(str(stale))
    with local_store.client() as grpc_client:
        grpc_client.put_generation(key, make_generation(key, layers=2, size=4096))
        want = as_dict(grpc_client.fetch(key, 0))
        served = local_store.metric("redknot_store_shards_served_total", 'path="local"')
        for path in (sock_dir / "absent.sock", stale):
            with local_store.client(local_socket=path) as c:
                assert as_dict(c.fetch(key, 0)) == want and as_dict(c.fetch(key, 1))
                assert c._warned_local
            with pytest.raises(NoLocalStore, match=str(path)):
                list(LocalStoreClient(path, TOKENS["acme"], timeout_s=5).fetch(key, 0))
        assert local_store.metric("redknot_store_shards_served_total", 'path="local"') == served
        with local_store.client(local_socket=local_store.socket_path) as c:   # where it listens, it is used
            assert as_dict(c.fetch(key, 0)) == want and not c._warned_local
        assert local_store.metric("redknot_store_shards_served_total", 'path="local"') > served
