"""The real stack on CUDA. TP=2 (a TP=2 worker and a TP=2 builder over NCCL, one process per GPU, rank r on cuda:r),
serving a small random checkpoint written in DeepSeek's official layout with FP8 and FP4 weights, skipped unless two
CUDA devices are visible; and TP=1 on one GPU in the serving dtype (bfloat16) with the GPU kernels on, the path
users take. On a GPU node `.devsvc/run.sh` (scripts/device_worker_gpu.sh) runs them.

Tolerance: the reference is the TP=1 reuse answer on the CPU in float32 (the same checkpoint, the same artifacts'
recipe). GPU TP=2 float32 arithmetic differs from it by reduction order only, so each greedy token must equal the
reference's wherever the reference's top-2 logit margin exceeds MARGIN; the comparison stops after the first
step under it (from there the two may legitimately take different paths). The fallback's answer must equal the
GPU recompute arm's exactly (the same kernels on the same tokens)."""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis
import torch

from runtime.model.checkpoint import build_demo_tokenizer, load_tokenizer, random_state, write_official_checkpoint
from runtime.model.config import tiny
from runtime.model.loader import load_model
from runtime.reuse.certificate import Certificate
from runtime.reuse.request import answer, build
from runtime.reuse.profile import load_profile
from services.common.serving import Binding, checkpoint_identity
from services.common.stack import LocalStack, StackConfig
from services.store.client import StoreClient
from services.store.keys import ShardKind

from .test_api_service import PROFILE, QUESTION, TENANTS, TEXTS, api, binding, doc_tokens, fallbacks, generate, \
    scrape, upload, wait_status

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (TP=2 over NCCL)")
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MARGIN = 1e-2           # logits; GPU-vs-CPU float32 differences are ~1e-5 here
N_NEW = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    d, tok = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_demo_tokenizer(512, tok)
    cfg = tiny(n_layers=8, vocab_size=load_tokenizer(tok).get_vocab_size())
    # exact_quant: the float32 values are the ones FP8 / FP4 storage holds, so every reader sees the same model
    write_official_checkpoint(d, cfg, random_state(cfg, seed=5, exact_quant=True), quantize=True, tokenizer_json=tok)
    return d


def running(cfg: StackConfig, redis_url: str, prefix: str):
    """The stack while the fixture lasts; then every service stopped cleanly and its Redis keys removed."""
    st = LocalStack(cfg).start()
    yield st
    codes = st.stop()
    r = redis.Redis.from_url(redis_url)
    for pat in (f"{prefix}:*", f"{prefix}-store:*"):
        for k in list(r.scan_iter(match=pat, count=1000)):
            r.delete(k)
    assert all(c == 0 for c in codes.values()), codes


@pytest.fixture(scope="module")
def stack(tmp_path_factory, checkpoint, redis_url):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices (TP=2 over NCCL)")
    prefix = f"rkgpu-{uuid.uuid4().hex[:8]}"
    cfg = StackConfig(workdir=tmp_path_factory.mktemp("stack"), model=checkpoint, tp=2, profile=PROFILE,
                      device="cuda", redis_url=redis_url, prefix=prefix, tenants=TENANTS,
                      # 4 layer groups of 2 layers; the torch reference path on the GPU (REDKNOT_KERNELS=0): the
                      # Triton kernels' dot products run in TF32 and are checked against it in tests/kernels
                      worker_env={"REDKNOT_WORKER_LAYER_GROUP": "2", "REDKNOT_KERNELS": "0"},
                      builder_env={"REDKNOT_KERNELS": "0"})
    yield from running(cfg, redis_url, prefix)


def reference(checkpoint: Path, texts: list[str], tmp: Path) -> tuple[list[int], list[float], dict]:
    """TP=1 reuse on the CPU: greedy tokens, each step's top-2 margin, the ledger."""
    model = load_model(checkpoint)
    ident, profile = checkpoint_identity(checkpoint), load_profile(PROFILE)
    docs = [doc_tokens(checkpoint, t) for t in texts]
    dirs = [build(model, d, profile, ident, tmp / f"ref{i}") for i, d in enumerate(docs)]
    out = answer(model, profile, docs, dirs, doc_tokens(checkpoint, QUESTION), ident, current_generation=1)
    assert out.arm == "reuse"
    tokens, margins = greedy_with_margins(out, model.cfg.eos_token_id)
    return tokens, margins, out.ledger.summary()


def greedy_with_margins(out, eos: int) -> tuple[list[int], list[float]]:
    """N_NEW greedy tokens of an Outcome and each step's top-2 logit margin."""
    tokens, margins, logits = [], [], out.logits
    for i in range(N_NEW):
        top = logits.float().topk(2).values
        tokens.append(int(logits.argmax()))
        margins.append(float(top[0] - top[1]))
        if tokens[-1] == eos or i == N_NEW - 1:
            break
        logits = out.step(tokens[-1])
    return tokens, margins


@two_gpus
def test_tp2_nccl_worker_serves_reuse_equal_to_tp1_and_falls_back_on_a_corrupt_late_group(stack, checkpoint,
                                                                                          tmp_path):
    log = stack.services["worker"].log(200_000)
    assert "rank 0 on cuda:0 (nccl)" in log and "rank 1 on cuda:1 (nccl)" in log, log[-2000:]
    texts = [TEXTS[0] * 3, TEXTS[1] * 3]
    with api(stack) as c:
        ids = [upload(c, t) for t in texts]
        for i in ids:
            wait_status(c, i, {"ready"})
        before = fallbacks(stack)
        out = generate(c, ids, "reuse", n=N_NEW)
        hot = generate(c, ids, "reuse", n=N_NEW)                        # from the host tier
    assert out["arm"] == "reuse" and out["fallback"] is None and hot["tokens"] == out["tokens"]
    assert fallbacks(stack) == before and sum(before.values()) == 0
    want, margins, ledger = reference(checkpoint, texts, tmp_path)
    for i, (got, ref, m) in enumerate(zip(out["tokens"], want, margins)):
        if m <= MARGIN:
            break
        assert got == ref, f"step {i}: {got} != {ref} (margin {m:.4f}): {out['tokens']} vs {want}"
    assert out["ledger"]["rows"] == ledger["rows"]

    # rank 1's LOCAL shard of the last reusable layer (layer 5: group 2 of 4) rots in the store, for two fresh
    # documents (latent shards are the same bytes on every rank, so the store keeps one blob for both)
    texts = [TEXTS[2] * 2, TEXTS[3] * 2]
    with api(stack) as c:
        ids = [upload(c, t) for t in texts]
        for i in ids:
            wait_status(c, i, {"ready"})
        key = binding(checkpoint).store_key(doc_tokens(checkpoint, texts[1]))
        with StoreClient(stack.store_target, TENANTS["acme"]) as client:
            spec = max((s for s in client.manifest(key).manifest.select(1) if s.kind is ShardKind.LOCAL),
                       key=lambda s: s.layers.lo)
        assert spec.layers.lo == 5
        blob = next((stack.workdir / "store").rglob(spec.digest))
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0x5A
        blob.write_bytes(bytes(data))
        before = fallbacks(stack)
        bad = generate(c, ids, "reuse", n=N_NEW)
        rec = generate(c, ids, "recompute", n=N_NEW)
    assert bad["arm"] == "recompute" and bad["ledger"] is None
    assert bad["fallback"]["reason"] == "digest_mismatch"
    assert bad["fallback"]["ranks"] == ["rank_disagreement", "digest_mismatch"]
    assert bad["tokens"] == rec["tokens"]
    after = fallbacks(stack)
    assert after["digest_mismatch"] == before["digest_mismatch"] + 1 and sum(after.values()) == sum(before.values()) + 1


# ------------------------------------------------------------------------------------------- TP=1, served dtype

BF16_MARGIN = 0.25      # logits: bf16 rounding differs between the in-process forward's and the served one's layouts


@pytest.fixture(scope="module")
def stack_bf16(tmp_path_factory, checkpoint, redis_url):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    prefix = f"rkgpu1-{uuid.uuid4().hex[:8]}"
    # the defaults: dtype auto (bfloat16 on CUDA), the GPU kernels on, the store's local socket, the pinned tier
    cfg = StackConfig(workdir=tmp_path_factory.mktemp("stack1"), model=checkpoint, tp=1, profile=PROFILE,
                      device="cuda", redis_url=redis_url, prefix=prefix, tenants=TENANTS,
                      worker_env={"REDKNOT_WORKER_LAYER_GROUP": "2"})
    yield from running(cfg, redis_url, prefix)


def reference_bf16(checkpoint: Path, texts: list[str], tmp: Path) -> tuple[list[int], list[float]]:
    """TP=1 reuse in this process on the GPU, bf16, kernels on: greedy tokens and each step's top-2 margin."""
    model = load_model(checkpoint, dtype=torch.bfloat16, device="cuda")
    ident = checkpoint_identity(checkpoint)
    profile = load_profile(PROFILE)
    docs = [doc_tokens(checkpoint, t) for t in texts]
    dirs = [build(model, d, profile, ident, tmp / f"bf{i}") for i, d in enumerate(docs)]
    out = answer(model, profile, docs, dirs, doc_tokens(checkpoint, QUESTION), ident, current_generation=1)
    assert out.arm == "reuse"
    return greedy_with_margins(out, model.cfg.eos_token_id)


@one_gpu
def test_tp1_worker_serves_bf16_artifacts_with_the_kernels_from_the_store_then_the_pinned_tier(stack_bf16, checkpoint,
                                                                                               tmp_path):
    st = stack_bf16
    assert "rank 0 on cuda (single process)" in st.services["worker"].log(200_000)
    texts = [TEXTS[0] * 3, TEXTS[1] * 3, TEXTS[2] * 2]
    with api(st) as c:
        ids = [upload(c, t) for t in texts]
        for i in ids:
            wait_status(c, i, {"ready"})
        cold = generate(c, ids, "reuse", n=N_NEW)             # fetched through the store's local socket
        hot = generate(c, ids, "reuse", n=N_NEW)              # every document from the pinned tier
        rec = generate(c, ids, "recompute", n=N_NEW)
    assert cold["arm"] == hot["arm"] == "reuse" and cold["fallback"] is None and hot["fallback"] is None
    assert hot["tokens"] == cold["tokens"]
    assert rec["arm"] == "recompute"
    # the artifacts were produced in the serving dtype, certified as such
    with StoreClient(st.store_target, TENANTS["acme"]) as client:
        key = Binding(checkpoint_identity(checkpoint), load_profile(PROFILE), 1, 1).store_key(
            doc_tokens(checkpoint, texts[0]))
        cert = next(s for s in client.fetch(key, 0, names=["certificate.msgpack"]))
    assert Certificate.from_bytes(cert.data).dtype == "bfloat16"
    m = scrape(st.metrics_targets()["worker"])
    assert m['redknot_cache_tier_requests_total{reason="resident",result="hit",tier="host"}'] >= len(texts)
    assert m['redknot_tier_bytes{rank="0"}'] > 0 and sum(fallbacks(st).values()) == 0
    want, margins = reference_bf16(checkpoint, texts, tmp_path)
    for i, (got, ref, mg) in enumerate(zip(hot["tokens"], want, margins)):
        if mg <= BF16_MARGIN:
            break
        assert got == ref, f"step {i}: {got} != {ref} (margin {mg:.4f}): {hot['tokens']} vs {want}"
