"""Round trips through a real store process: generic shards, runtime artifact directories, dedup, selection."""
from __future__ import annotations

import pytest

from services.store.errors import NotFound
from services.store.keys import Range, ShardKind

from .conftest import doc_key, fetch_all, make_generation


def test_put_commit_manifest_fetch_round_trip(client):
    key = doc_key("round-trip")
    shards = make_generation(key, tag="one")
    res = client.put_generation(key, shards)
    assert res.manifest.generation == 1 and res.became_current and res.current_generation == 1
    m = client.manifest(key)
    assert m.current_generation == 1 and m.generations == (1,)
    assert sorted(s.ref for s in m.manifest.shards) == sorted(s.ref for s, _ in shards)
    for rank in range(key.tp_size):
        got = fetch_all(client, key, rank)
        assert got == {s.name: d for s, d in shards if s.rank == rank}


def test_selection_by_layer_group_channels_and_names(client):
    key = doc_key("select")
    client.put_generation(key, make_generation(key, layers=4))
    names = [s.spec.name for s in client.fetch(key, 1, layers=Range(1, 3))]
    assert names == sorted(["layer01.latent.safetensors", "layer02.latent.safetensors",
                            "layer01.local.r1.c64-128.safetensors", "layer02.local.r1.c64-128.safetensors"])
    # LOCAL shards outside the channel range drop out; shards without channels stay
    kinds = {s.spec.kind for s in client.fetch(key, 1, channels=Range(0, 64))}
    assert ShardKind.LOCAL not in kinds and ShardKind.CERTIFICATE in kinds
    assert [s.spec.name for s in client.fetch(key, 0, names=["manifest.msgpack"])] == ["manifest.msgpack"]
    with pytest.raises(NotFound):
        list(client.fetch(key, 0, names=["nope.bin"]))


def test_unchanged_shards_are_not_uploaded_again(store, client):
    key = doc_key("dedup")
    first = make_generation(key, tag="same")
    client.put_generation(key, first)
    before = store.metric("redknot_store_bytes_in_total")
    b = client.begin(key, [s for s, _ in first], generation=0)
    assert b.generation == 2 and sorted(b.already_stored) == sorted(s.ref for s, _ in first)
    client.commit(b.upload_id)
    assert store.metric("redknot_store_bytes_in_total") == before
    assert client.manifest(key).generations == (1, 2)


def test_runtime_artifact_directories_round_trip(client, tmp_path):
    """A generation written by runtime.reuse.store for TP=2 goes up from its directories and comes back as
    directories that load_artifact accepts bit-exactly."""
    from runtime.reuse.store import load_artifact, save_artifact
    from services.store.artifact_dir import document_key
    from tests.reuse.test_store import assert_same, cert_fields, expect_for, make_artifact

    from runtime.reuse.certificate import Certificate, digest_bytes
    fingerprint = digest_bytes(b"a real checkpoint fingerprint is blake3 hex")
    arts = [make_artifact(rank=r, size=2) for r in range(2)]
    dirs = []
    for art in arts:
        d = tmp_path / f"produced-r{art.tp_rank}"
        save_artifact(art, d, dict(cert_fields(art, generation=5), fingerprint=fingerprint))
        dirs.append(d)
    res = client.put_artifact(dirs)
    assert res.manifest.generation == 5 and res.current_generation == 5
    key = res.manifest.key
    for art in arts:
        out = tmp_path / f"fetched-r{art.tp_rank}"
        got = client.fetch_rank(key, art.tp_rank, out)
        assert got.generation == 5 and "certificate.msgpack" in got.files
        loaded, verdict = load_artifact(out, expect_for(art, current_generation=5, fingerprint=fingerprint))
        assert verdict.ok, verdict
        assert_same(art, loaded)
        # the store's verdict agrees with the worker's own
        cert = Certificate.from_bytes((out / "certificate.msgpack").read_bytes())
        v = client.validate(key, art.tp_rank, channels=Range(*cert.channel_range), layers_needed=cert.layers,
                            generation=5, certificate_digest=digest_bytes((out / "certificate.msgpack").read_bytes()),
                            deep=True)
        assert v.ok, v
        assert document_key(cert, art.n_content) == key
    with pytest.raises(FileExistsError):
        client.fetch_rank(key, 0, tmp_path / "fetched-r0")
