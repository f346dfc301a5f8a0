"""The artifact store: bit-exact round trip, every reject load can produce (with no artifact returned), the
write order that makes a half-written artifact unreadable, and agree over TP=2 gloo on a corrupted shard."""
import json
import os
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import runtime.reuse.store as store
from runtime.model.parallel import Parallel
from runtime.reuse.artifact import DocumentArtifact, LayerArtifact
from runtime.reuse.certificate import Certificate, FallbackCounter, FallbackReason, agree, token_hash
from runtime.reuse.profile import FLASH_PROFILE
from runtime.reuse.store import CERTIFICATE_FILE, MANIFEST_FILE, load_artifact, save_artifact

R = FallbackReason
N, N_CONTENT, D, CH = 256, 250, 16, 32      # rows, content rows, latent dim, projected channels per rank
TOK = "tok-fp"


def make_artifact(rank: int = 0, size: int = 2, seed: int = 0) -> DocumentArtifact:
    """L0 window-only fence; L1 CSA (entries, indexer keys, boundary pairs, local_p bf16); L2 HCA (local_p fp32)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    tokens = torch.randint(2, 1000, (N_CONTENT,), generator=g).tolist() + [1] * (N - N_CONTENT)
    buf = r(2, 4, 2 * D, dtype=torch.float32)       # kv and gate views of one buffer, as a compressor keeps them
    layers = [
        LayerArtifact(latent=r(N, D)),
        LayerArtifact(latent=r(N, D), entries=r(N // 4, D), index_keys=r(N // 4, 8), comp_prev=(buf[0], buf[1]),
                      index_prev=(r(4, 16, dtype=torch.float32), r(4, 16, dtype=torch.float32)), local_p=r(N, CH)),
        LayerArtifact(latent=r(N, D), entries=r(N // 128, D), local_p=r(N, CH, dtype=torch.float32)),
    ]
    return DocumentArtifact(tokens=tokens, n_content=N_CONTENT, layers=layers, tp_rank=rank, tp_size=size,
                            meta={"doc_id": "d-17", "profile": "flash"})


def cert_fields(art: DocumentArtifact, generation: int = 3) -> dict:
    return dict(fingerprint="ckpt-fp", token_hash=token_hash(art.tokens, TOK), profile=FLASH_PROFILE,
                channel_range=(art.tp_rank * CH, (art.tp_rank + 1) * CH), dtype="bfloat16",
                producer_version="redknot 0.1.0", generation=generation)


def expect_for(art: DocumentArtifact, **kw) -> dict:
    base = dict(fingerprint="ckpt-fp", tokens_hash=token_hash(art.tokens, TOK), profile=FLASH_PROFILE.to_dict(),
                tp_size=art.tp_size, tp_rank=art.tp_rank, channel_range=(art.tp_rank * CH, (art.tp_rank + 1) * CH),
                layers_needed={0, 1, 2}, current_generation=3, dtype="bfloat16", producer_version="redknot 0.1.0")
    base.update(kw)
    return base


def assert_same(a: DocumentArtifact, b: DocumentArtifact) -> None:
    assert (a.tokens, a.n_content, a.tp_rank, a.tp_size, a.meta) == (b.tokens, b.n_content, b.tp_rank, b.tp_size, b.meta)
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        for f in ("latent", "entries", "index_keys", "comp_prev", "index_prev", "local_p"):
            x, y = getattr(la, f), getattr(lb, f)
            assert (x is None) == (y is None), f
            for tx, ty in zip(x, y) if isinstance(x, tuple) else ([(x, y)] if x is not None else []):
                assert tx.dtype == ty.dtype and tx.shape == ty.shape, f
                assert torch.equal(tx.view(torch.uint8) if tx.dtype == torch.bfloat16 else tx,
                                   ty.view(torch.uint8) if ty.dtype == torch.bfloat16 else ty), f


@pytest.fixture
def saved(tmp_path):
    art = make_artifact(rank=1)
    d = tmp_path / "doc"
    cert = save_artifact(art, d, cert_fields(art))
    return art, d, cert


def test_round_trip_is_bit_exact(saved):
    art, d, cert = saved
    files = sorted(p.name for p in d.iterdir())
    assert files == sorted([CERTIFICATE_FILE, MANIFEST_FILE, "layer00.latent.safetensors",
                            "layer01.latent.safetensors", "layer01.local.r1.c32-64.safetensors",
                            "layer02.latent.safetensors", "layer02.local.r1.c32-64.safetensors"])
    assert set(cert.shard_digests) == {f.removesuffix(".safetensors") for f in files if f.startswith("layer")} | {"manifest"}
    assert cert.layers == (0, 1, 2) and cert.n_tokens == N and cert.channel_range == (32, 64)
    assert cert.profile == FLASH_PROFILE.to_dict()
    got, v = load_artifact(d, expect_for(art))
    assert v.ok and v.reason is None
    assert_same(art, got)
    assert got.layers[2].local_p.dtype == torch.float32 and got.layers[1].local_p.dtype == torch.bfloat16


def test_certificate_is_written_last_and_immutable(tmp_path, monkeypatch):
    order = []
    real = os.replace
    monkeypatch.setattr(store.os, "replace", lambda a, b: (order.append(Path(b).name), real(a, b)))
    art = make_artifact()
    save_artifact(art, tmp_path / "doc", cert_fields(art))
    assert order[-1] == CERTIFICATE_FILE and order[-2] == MANIFEST_FILE and len(order) == 7
    assert not [p for p in (tmp_path / "doc").iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(FileExistsError):
        save_artifact(art, tmp_path / "doc", cert_fields(art))


def test_local_p_must_match_channel_range(tmp_path):
    art = make_artifact()
    with pytest.raises(ValueError, match="channels"):
        save_artifact(art, tmp_path / "doc", {**cert_fields(art), "channel_range": (0, CH + 1)})


def _flip(path: Path, at: int = -1) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0x01
    path.write_bytes(bytes(b))


def _break(kind: str, d: Path) -> None:
    if kind == "deleted shard":
        (d / "layer02.local.r1.c32-64.safetensors").unlink()
    elif kind == "flipped byte":        # in the tensor data, so safetensors alone would parse it happily
        _flip(d / "layer01.latent.safetensors")
    elif kind == "flipped header byte":
        _flip(d / "layer00.latent.safetensors", at=20)
    elif kind == "truncated shard":
        p = d / "layer02.latent.safetensors"
        p.write_bytes(p.read_bytes()[:-7])
    elif kind == "flipped manifest":
        _flip(d / MANIFEST_FILE, at=len((d / MANIFEST_FILE).read_bytes()) // 2)
    elif kind == "deleted manifest":
        (d / MANIFEST_FILE).unlink()
    elif kind == "no certificate":
        (d / CERTIFICATE_FILE).unlink()
    elif kind == "garbage certificate":
        (d / CERTIFICATE_FILE).write_bytes(b"\xc1not msgpack")
    elif kind == "truncated certificate":
        p = d / CERTIFICATE_FILE
        p.write_bytes(p.read_bytes()[:40])
    elif kind == "unreadable certificate":
        (d / CERTIFICATE_FILE).unlink()
        (d / CERTIFICATE_FILE).mkdir()         # reading it is an OS error, not a missing file
    elif kind == "no directory":
        for p in d.iterdir():
            p.unlink()
        d.rmdir()
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind, reason", [
    ("deleted shard", R.MISSING_SHARD), ("flipped byte", R.DIGEST_MISMATCH),
    ("flipped header byte", R.DIGEST_MISMATCH), ("truncated shard", R.DIGEST_MISMATCH),
    ("flipped manifest", R.DIGEST_MISMATCH), ("deleted manifest", R.MISSING_SHARD),
    ("no certificate", R.MISSING_SHARD), ("garbage certificate", R.MISSING_SHARD),
    ("truncated certificate", R.MISSING_SHARD), ("unreadable certificate", R.STORE_UNAVAILABLE),
    ("no directory", R.MISSING_SHARD)])
def test_damaged_store_is_rejected(saved, kind, reason):
    art, d, _ = saved
    _break(kind, d)
    got, v = load_artifact(d, expect_for(art))
    assert got is None and not v.ok and v.reason is reason and v.detail, v


@pytest.mark.parametrize("kw, reason", [
    (dict(fingerprint="other-ckpt"), R.CHECKPOINT_MISMATCH),
    ("changed token", R.TOKEN_MISMATCH),
    (dict(tokens_hash=None), R.TOKEN_MISMATCH),          # same tokens, other tokenizer
    (dict(profile=FLASH_PROFILE.replace(tau=0.8).to_dict()), R.PROFILE_MISMATCH),
    (dict(profile=FLASH_PROFILE.replace(ffn_mode="native")), R.PROFILE_MISMATCH),
    (dict(tp_rank=0), R.TP_GEOMETRY_MISMATCH),
    (dict(tp_size=4), R.TP_GEOMETRY_MISMATCH),
    (dict(channel_range=(32, 48)), R.TP_GEOMETRY_MISMATCH),
    (dict(layers_needed={0, 1, 2, 3}), R.MISSING_LAYER),
    (dict(current_generation=4), R.STALE_GENERATION),
    (dict(dtype="float32"), R.PRODUCER_MISMATCH), (dict(producer_version="redknot 0.0.9"), R.PRODUCER_MISMATCH)])
def test_mismatched_request_is_rejected(saved, kw, reason):
    art, d, _ = saved
    if kw == "changed token":
        tokens = list(art.tokens)
        tokens[100] += 1
        kw = dict(tokens_hash=token_hash(tokens, TOK))
    elif kw == dict(tokens_hash=None):
        kw = dict(tokens_hash=token_hash(art.tokens, "other-tokenizer"))
    got, v = load_artifact(d, expect_for(art, **kw))
    assert got is None and not v.ok and v.reason is reason and v.detail, v


def test_older_generation_beside_newer(tmp_path):
    # a store keeps generations side by side; only the current one is served
    art = make_artifact(rank=1)
    save_artifact(art, tmp_path / "g3", cert_fields(art, generation=3))
    save_artifact(art, tmp_path / "g4", cert_fields(art, generation=4))
    assert load_artifact(tmp_path / "g3", expect_for(art, current_generation=4))[1].reason is R.STALE_GENERATION
    got, v = load_artifact(tmp_path / "g4", expect_for(art, current_generation=4))
    assert v.ok and got is not None


def test_bad_expect_is_a_caller_error(saved):
    art, d, _ = saved
    e = expect_for(art)
    del e["current_generation"]
    with pytest.raises(ValueError, match="current_generation"):
        load_artifact(d, e)


# ------------------------------------------------------------------------------------------ agree over gloo

def _rendezvous(d) -> str:
    """A fresh file for the ranks' rendezvous (torch.distributed's FileStore), not a TCP port: a port picked here and
    bound later by rank 0 could be taken in between by a parallel test process."""
    return f"file://{Path(d) / f'rdzv-{uuid.uuid4().hex}'}"


def _rank(rank: int, size: int, init: str, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        art = make_artifact(rank=rank, size=size)
        d = Path(root) / f"r{rank}"
        got, own = load_artifact(d, expect_for(art))
        cert = Certificate.from_bytes((d / CERTIFICATE_FILE).read_bytes())
        v = agree(own, Parallel(rank, size), binding=cert.binding_digest())
        result = {"loaded": got is not None, "own": [own.ok, own.reason and own.reason.value],
                  "agreed": [v.ok, v.reason and v.reason.value, v.detail]}
        (Path(root) / f"result{rank}.json").write_text(json.dumps(result))
        dist.barrier()      # no rank tears gloo down while its peer still uses it
    finally:
        dist.destroy_process_group()


def test_agree_over_tp2_gloo(tmp_path):
    for rank in range(2):
        art = make_artifact(rank=rank, size=2)
        save_artifact(art, tmp_path / f"r{rank}", cert_fields(art))
    _flip(tmp_path / "r1" / "layer01.local.r1.c32-64.safetensors")
    mp.start_processes(_rank, args=(2, _rendezvous(tmp_path), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2))
    assert r0["loaded"] and r0["own"] == [True, None]
    assert not r1["loaded"] and r1["own"] == [False, "digest_mismatch"]
    assert r0["agreed"][:2] == [False, "rank_disagreement"] and "rank 1: digest_mismatch" in r0["agreed"][2]
    assert r1["agreed"][:2] == [False, "digest_mismatch"]
    counter = FallbackCounter()
    for r in (r0, r1):
        counter.inc(r["agreed"][1])
    snap = counter.snapshot()
    assert snap["rank_disagreement"] == 1 and snap["digest_mismatch"] == 1 and sum(snap.values()) == 2


def test_read_layers_hashes_once_and_trusts_only_the_certified_digest(saved, monkeypatch):
    """Shards that a store client already checked (`VerifiedFiles`: the digest their bytes matched) are compared by
    digest with the certificate instead of hashed again; without that claim, or with a claim of another digest,
    every shard is hashed, so altered bytes are still rejected with digest_mismatch."""
    art, d, cert = saved
    files = {p.name: p.read_bytes() for p in d.iterdir()}
    head, v = store.read_head(files, expect_for(art))
    assert v.ok
    names = sorted(n for n in files if n.startswith("layer"))
    hashed = []
    real = store.digest_bytes
    monkeypatch.setattr(store, "digest_bytes", lambda b, parallel=False: hashed.append(len(b)) or real(b, parallel))
    layers, v = store.read_layers(head, [0, 1, 2], files)
    assert v.ok and len(hashed) == len(names)                          # plain bytes: every shard hashed
    hashed.clear()
    claimed = store.VerifiedFiles(files, {n: cert.shard_digests[n.removesuffix(".safetensors")] for n in names})
    got, v = store.read_layers(head, [0, 1, 2], claimed)
    assert v.ok and not hashed                                         # checked on the way in: compared, not hashed
    assert_same(DocumentArtifact(art.tokens, art.n_content, got, art.tp_rank, art.tp_size, art.meta),
                load_artifact(d, expect_for(art))[0])
    bad = dict(files)
    victim = names[1]
    bad[victim] = bad[victim][:-1] + bytes([bad[victim][-1] ^ 1])
    wrong = store.VerifiedFiles(bad, {**claimed.digests, victim: "0" * 64})   # a claim that is not the certified one
    _, v = store.read_layers(head, [0, 1, 2], wrong)
    assert not v.ok and v.reason == R.DIGEST_MISMATCH and victim.removesuffix(".safetensors") in v.detail
