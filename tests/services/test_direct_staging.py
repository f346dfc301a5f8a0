"""Shards read straight into their layers' slabs through the store's local socket (runtime.reuse.direct,
`LocalStoreClient.fetch_into`, the worker's `Prefetcher._direct`): a real store process hands the worker each blob's
descriptor and the bytes go once from the page cache into the slab that the tier keeps.

Proven here: the layers equal, bit for bit, what the byte path (`read_layers`, then `pin_layers`) makes of the same
shards, in the same packed layout (one copy per layer to the device); the worker's reuse answer through this path
equals `answer` over whole directories and the tier keeps these very slabs; and every fault still falls back with its
reason: a corrupt blob (digest_mismatch, the store told), a header that disagrees with the manifest
(digest_mismatch), a shard that never came (missing_shard), a socket nobody listens on (the gRPC stream instead)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import safetensors.torch
import torch

from runtime.model.parallel import Parallel
from runtime.reuse.certificate import FallbackReason, digest_bytes
from runtime.reuse.direct import DirectGroup
from runtime.reuse.packing import _layout, layer_tensors, packed_storage, pin_layers
from runtime.reuse.roles import channel_range
from runtime.reuse.greedy import greedy
from runtime.reuse.stager import Trace
from runtime.reuse.store import read_head, read_layers, shard_file
from services.common.failpoints import Failpoints
from services.common.serving import Binding
from services.common.tenants import Tenants
from services.common.tp import RankGroup
from services.store.errors import DataLoss
from services.store.keys import Range, ShardKind, ShardSpec
from services.store.local_client import LocalStoreClient, read_placed
from services.worker.engine import RankEngine
from services.worker.prefetch import Prefetcher
from services.worker.tier import PinnedTier

from .conftest import TOKENS
from .test_worker_staging import CFG, IDENT, PROF, _request, setup, whole  # noqa: F401 (setup: a fixture)

GROUP = 2           # layers per fetch stream, as the staging tests' engine


@pytest.fixture
def local_store(store_factory):
    d = Path(tempfile.mkdtemp(prefix="rk-", dir="/tmp"))      # a Unix socket path must stay under 108 bytes
    proc = store_factory(extra_args=["--local-socket", str(d / "store.sock")]).start()
    proc.socket_path = d / "store.sock"
    yield proc
    shutil.rmtree(d, ignore_errors=True)


def _engine(model, store, socket_path, trace=None) -> RankEngine:
    group = RankGroup(0, 1, torch.device("cpu"), Parallel())
    pf = Prefetcher(PinnedTier(1 << 30), Tenants(TOKENS), store.target, 0, channel_range(CFG, 0, 1), CFG.n_layers,
                    GROUP, 4, trace, local_socket=str(socket_path))
    return RankEngine(group, model, Binding(IDENT, PROF, 1, CFG.eos_token_id), pf, Failpoints(""), trace)


def _head(d: Path):
    head, v = read_head({n: (d / n).read_bytes() for n in ("certificate.msgpack", "manifest.msgpack")}, None)
    assert v.ok, v
    return head


def _same(a, b) -> None:
    ta, tb = layer_tensors(a), layer_tensors(b)
    assert len(ta) == len(tb) and len(ta) > 0
    for x, y in zip(ta, tb):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_layers_read_into_slabs_equal_the_byte_path_bit_for_bit_in_the_packed_layout(setup, local_store):
    m, docs, question, dirs = setup
    with local_store.client() as c, LocalStoreClient(local_store.socket_path, TOKENS["acme"], threads=3) as lc:
        for d in dirs:
            c.put_artifact([d])
        eng = _engine(m, local_store, local_store.socket_path)
        try:
            key = eng.key(docs[1])
        finally:
            eng.prefetcher.close()
        head = _head(dirs[1])
        for lo in range(0, CFG.n_layers, GROUP):
            layers = range(lo, min(lo + GROUP, CFG.n_layers))
            group = DirectGroup(head, layers, pinned=False)
            got = list(lc.fetch_into(key, 0, lambda fd, spec: group.place(fd, spec.name, spec.size), generation=1,
                                     layers=Range(layers.start, layers.stop)))
            assert got and all(s.data is None for s in got)
            for s in got:
                group.verified(s.spec.name, s.spec.digest)
            arts, v = group.result(head)
            assert v.ok, v
            files = {f: (dirs[1] / f).read_bytes() for f in head.files(layers)}
            assert group.nbytes == sum(len(b) for b in files.values())
            want, v = read_layers(head, layers, files)
            assert v.ok
            for a, b in zip(arts, pin_layers(want)):
                _same(a, b)
                # laid out as pin_layers lays it out: the device copy takes the whole layer in one copy
                ts = layer_tensors(a)
                flat = packed_storage(a)
                assert flat is not None and flat.numel() == _layout(ts)[1]


def test_a_header_that_disagrees_with_the_manifest_and_a_shard_that_never_came_reject_the_group(setup, tmp_path):
    m, docs, question, dirs = setup
    head = _head(dirs[0])
    layers = range(0, GROUP)
    files = head.files(layers)
    # a committed blob (its bytes hash to the store's digest) whose tensors are not the manifest's
    bad = safetensors.torch.save({"latent": torch.zeros(3, 5)})
    path = tmp_path / "bad.safetensors"
    path.write_bytes(bad)
    group = DirectGroup(head, layers, pinned=False)
    fd = os.open(path, os.O_RDONLY)
    try:
        spec = ShardSpec(files[0], 0, ShardKind.LATENT, digest_bytes(bad), len(bad))
        read_placed(fd, spec, lambda fd, spec: group.place(fd, spec.name, spec.size))
    finally:
        os.close(fd)
    group.verified(files[0], digest_bytes(bad))
    arts, v = group.result(head)
    assert arts is None and v.reason is FallbackReason.DIGEST_MISMATCH and "manifest" in v.detail

    # every shard read but one: the group names the missing one
    group = DirectGroup(head, layers, pinned=False)
    for f in files[:-1]:
        data = (dirs[0] / f).read_bytes()
        fd = os.open(dirs[0] / f, os.O_RDONLY)
        try:
            read_placed(fd, ShardSpec(f, 0, ShardKind.LATENT, digest_bytes(data), len(data)),
                        lambda fd, spec: group.place(fd, spec.name, spec.size))
        finally:
            os.close(fd)
        group.verified(f, digest_bytes(data))
    arts, v = group.result(head)
    assert arts is None and v.reason is FallbackReason.MISSING_SHARD and files[-1].removesuffix(".safetensors") in v.detail

    # bytes that do not hash to the store's digest never count as read
    f = files[0]
    data = (dirs[0] / f).read_bytes()
    group = DirectGroup(head, layers, pinned=False)
    fd = os.open(dirs[0] / f, os.O_RDONLY)
    try:
        with pytest.raises(DataLoss, match="do not hash"):
            read_placed(fd, ShardSpec(f, 0, ShardKind.LATENT, "0" * 64, len(data)),
                        lambda fd, spec: group.place(fd, spec.name, spec.size))
        with pytest.raises(DataLoss, match="holds"):           # the blob is longer than committed
            read_placed(fd, ShardSpec(f, 0, ShardKind.LATENT, digest_bytes(data[:-1]), len(data) - 1),
                        lambda fd, spec: group.place(fd, spec.name, spec.size))
    finally:
        os.close(fd)


def test_the_worker_serves_from_slabs_read_through_the_local_socket_and_falls_back_on_a_corrupt_blob(
        setup, local_store, tmp_path):
    m, docs, question, dirs = setup
    ref = whole(setup)
    want = greedy(ref.logits, ref.step, 5, {CFG.eos_token_id}, True)
    with local_store.client() as c:
        for d in dirs:
            c.put_artifact([d])
        trace = Trace()
        eng = _engine(m, local_store, local_store.socket_path, trace)
        try:
            cold, reports = eng.run(_request(docs, question))
            assert cold.arm == "reuse" and cold.fallback is None and cold.tokens == want
            assert cold.ledger["rows"] == ref.ledger.summary()["rows"]
            fetched = reports[0].fetch
            # every layer shard came straight into the slabs (the head alone came as bytes)
            assert fetched.placed > 0 and fetched.bytes - fetched.placed < 64 << 10
            assert [g for e, g in trace.events if e == "consume"] == list(range(-(-CFG.n_layers // GROUP)))
            # the tier keeps those very slabs: packed layers, a repeated request is a hit that fetches nothing
            assert len(eng.tier.keys()) == 2
            for tkey in eng.tier.keys():
                entry = eng.tier.lookup(tkey, count=False)
                assert all(packed_storage(la) is not None for la in entry.doc.layers)
                eng.tier.release(tkey)
            hot, reports = eng.run(_request(docs, question))
            assert hot.arm == "reuse" and hot.tokens == want and reports[0].tier.hits == 2
            assert reports[0].fetch.bytes == 0
            rec, _ = eng.run(_request(docs, question, "recompute"))
        finally:
            eng.prefetcher.close()

        # a late group's blob corrupt in the store: a fresh worker falls back, names the document, keeps nothing
        # of it, and the store counts the failure it was told of
        key = eng.key(docs[1])
        spec = next(s for s in c.manifest(key).manifest.select(0) if s.name.startswith(f"layer{CFG.n_layers - 1:02d}."))
        blob = next(local_store.blob_root.rglob(spec.digest))
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0x5A
        blob.write_bytes(bytes(data))
        before = local_store.metric("redknot_store_digest_failures_total", 'stage="read"')
        fresh = _engine(m, local_store, local_store.socket_path)
        try:
            out, _ = fresh.run(_request(docs, question))
            assert out.arm == "recompute" and out.fallback.reason == "digest_mismatch" and out.tokens == rec.tokens
            assert out.fallback.document == "d1"
            assert len(fresh.tier.keys()) <= 1
        finally:
            fresh.prefetcher.close()
        assert local_store.metric("redknot_store_digest_failures_total", 'stage="read"') == before + 1


def test_a_socket_no_store_listens_on_means_the_grpc_stream(setup, local_store, tmp_path):
    m, docs, question, dirs = setup
    ref = whole(setup)
    with local_store.client() as c:
        for d in dirs:
            c.put_artifact([d])
    eng = _engine(m, local_store, tmp_path / "nobody.sock")
    try:
        out, reports = eng.run(_request(docs, question))
        assert out.arm == "reuse" and out.fallback is None
        assert out.tokens == greedy(ref.logits, ref.step, 5, {CFG.eos_token_id}, True)
        assert reports[0].fetch.bytes > 0 and reports[0].fetch.placed == 0
    finally:
        eng.prefetcher.close()
