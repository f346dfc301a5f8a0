"""The real stack with a TP=2 worker and a TP=2 builder on CUDA over NCCL (one process per GPU, rank r on cuda:r),
serving a small random checkpoint written in DeepSeek's official layout with FP8 and FP4 weights. Skipped unless
two CUDA devices are visible; on a GPU node `.devsvc/run.sh` (scripts/device_worker_gpu.sh) runs it.

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
from runtime.reuse.request import answer, build
from services.common.serving import checkpoint_identity, load_profile
from services.common.stack import LocalStack, StackConfig
from services.store.client import StoreClient
from services.store.keys import ShardKind

from .test_api_service import PROFILE, QUESTION, TENANTS, TEXTS, api, binding, doc_tokens, fallbacks, generate, \
    upload, wait_status

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (TP=2 over NCCL)")
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


@pytest.fixture(scope="module")
def stack(tmp_path_factory, checkpoint, redis_url):
    prefix = f"rkgpu-{uuid.uuid4().hex[:8]}"
    cfg = StackConfig(workdir=tmp_path_factory.mktemp("stack"), model=checkpoint, tp=2, profile=PROFILE,
                      device="cuda", redis_url=redis_url, prefix=prefix, tenants=TENANTS,
                      # 4 layer groups of 2 layers; the torch reference path on the GPU (REDKNOT_KERNELS=0): the
                      # Triton kernels' dot products run in TF32 and are checked against it in tests/kernels
                      worker_env={"REDKNOT_WORKER_LAYER_GROUP": "2", "REDKNOT_KERNELS": "0"},
                      builder_env={"REDKNOT_KERNELS": "0"})
    st = LocalStack(cfg).start()
    yield st
    codes = st.stop()
    r = redis.Redis.from_url(redis_url)
    for pat in (f"{prefix}:*", f"{prefix}-store:*"):
        for k in list(r.scan_iter(match=pat, count=1000)):
            r.delete(k)
    assert all(c == 0 for c in codes.values()), codes


def reference(checkpoint: Path, texts: list[str], tmp: Path) -> tuple[list[int], list[float], dict]:
    """TP=1 reuse on the CPU: greedy tokens, each step's top-2 margin, the ledger."""
    model = load_model(checkpoint)
    ident, profile = checkpoint_identity(checkpoint), load_profile(PROFILE)
    docs = [doc_tokens(checkpoint, t) for t in texts]
    dirs = [build(model, d, profile, ident, tmp / f"ref{i}") for i, d in enumerate(docs)]
    out = answer(model, profile, docs, dirs, doc_tokens(checkpoint, QUESTION), ident, current_generation=1)
    assert out.arm == "reuse"
    tokens, margins, logits = [], [], out.logits
    for i in range(N_NEW):
        top = logits.float().topk(2).values
        tokens.append(int(logits.argmax()))
        margins.append(float(top[0] - top[1]))
        if tokens[-1] == model.cfg.eos_token_id or i == N_NEW - 1:
            break
        logits = out.step(tokens[-1])
    return tokens, margins, out.ledger.summary()


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
