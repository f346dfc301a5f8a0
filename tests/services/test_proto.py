"""The contract: buf lint passes, the committed generated code is what proto/generate.py makes from the
.proto today, the store's fallback reasons are the runtime's, and a live server offers health and reflection."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import grpc

from .conftest import ROOT


def test_buf_lint_passes():
    buf = Path(sys.executable).parent / "buf"
    buf = str(buf) if buf.exists() else shutil.which("buf")
    assert buf, "buf not installed (pip install buf-bin)"
    r = subprocess.run([buf, "lint"], cwd=ROOT / "proto", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([buf, "format", "--diff", "--exit-code"], cwd=ROOT / "proto", capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, "proto/ is not buf-formatted:\n" + r.stdout + r.stderr


def test_generated_code_matches_proto(tmp_path):
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    committed = ROOT / "services" / "store" / "pb"
    for name in gen.FILES:
        assert (tmp_path / name).read_text() == (committed / name).read_text(), \
            f"services/store/pb/{name} is stale: run `make proto` (or python proto/generate.py)"


def test_fallback_reasons_are_the_runtimes():
    from runtime.reuse.certificate import FallbackReason
    from services.store import wire
    from services.store.keys import Reason
    assert [r.value for r in Reason] == [r.value for r in FallbackReason]
    assert len(set(wire.REASON_TO_PB.values())) == len(Reason)


def test_digest_is_the_runtimes():
    from runtime.reuse.certificate import digest_bytes as runtime_digest
    from services.store.keys import digest_bytes, new_hasher
    data = bytes(range(256)) * 40000
    h = new_hasher()
    h.update(data)
    assert digest_bytes(data) == runtime_digest(data) == h.hexdigest()


def test_health_and_reflection(store):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    with grpc.insecure_channel(store.target) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(
            service="redknot.store.v1.ArtifactStoreService"), timeout=5)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), timeout=5)))
        names = {s.name for s in resp.list_services_response.service}
        assert "redknot.store.v1.ArtifactStoreService" in names and "grpc.health.v1.Health" in names


def test_hand_serialized_fetch_response_equals_protobufs():
    from services.store import wire
    from services.store.keys import Range, ShardKind, ShardSpec
    from services.store.pb import artifact_store_pb2 as pb
    spec = ShardSpec("layer01.local.r1.c64-128.safetensors", 1, ShardKind.LOCAL, "ab" * 32, 300, Range(1, 2),
                     Range(64, 128))
    for shard, data, last in ((spec, b"x" * 300, True), (None, b"y" * 200_000, False), (spec, b"", True)):
        raw = wire.fetch_response_bytes(shard, 7, 4096, data, last)
        want = pb.FetchShardsResponse(shard=wire.shard_to_pb(shard) if shard else None, generation=7, offset=4096,
                                      data=data, last=last)
        assert pb.FetchShardsResponse.FromString(raw) == want
