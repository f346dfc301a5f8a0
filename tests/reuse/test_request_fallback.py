"""Every fallback reason a request can meet fires, is counted, and yields exactly full recomputation; a request
whose artifacts verify runs the reuse arm and says so."""
import os

import pytest
import torch

from runtime.model.config import tiny
from runtime.reuse.certificate import FallbackCounter, FallbackReason as R
from runtime.reuse.producer import pad_document
from runtime.reuse.profile import ReuseProfile
from runtime.reuse.request import ServingIdentity, answer, build
from tests.tiny import tiny_model

CFG = tiny(n_layers=6, compress_ratios=(0, 4, 16, 4, 16, 4), n_hash_layers=2)
PROF = ReuseProfile(first_fences=2, last_fences=2, align=16, budget=0.25, recent_rows=16, join_rows=8)
IDENT = ServingIdentity("f" * 64, "tok-v1")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    m = tiny_model(CFG, seed=11)
    g = torch.Generator().manual_seed(12)
    docs = [torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist() for n in (40, 70, 30)]
    question = torch.randint(2, CFG.vocab_size, (10,), generator=g).tolist()
    root = tmp_path_factory.mktemp("arts")
    dirs = [build(m, d, PROF, IDENT, root / f"doc{i}", generation=1) for i, d in enumerate(docs)]
    full = torch.tensor([t for d in docs for t in pad_document(d, 16, CFG.eos_token_id)] + question)
    return m, docs, question, dirs, m(full)


def test_verified_artifacts_run_the_reuse_arm(setup):
    m, docs, question, dirs, ref = setup
    out = answer(m, PROF, docs, dirs, question, IDENT, current_generation=1)
    assert out.arm == "reuse" and out.verdict.ok and out.ledger.active > 0
    assert not torch.equal(out.logits, ref)          # approximate, and it did not silently recompute


def _corrupt(path):
    shard = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))[1]
    data = bytearray((path / shard).read_bytes())
    data[-1] ^= 0x01
    (path / shard).write_bytes(bytes(data))


def _delete(path):
    os.remove(path / sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))[0])


CASES = {
    R.CHECKPOINT_MISMATCH: dict(ident=ServingIdentity("0" * 64, "tok-v1")),
    R.PROFILE_MISMATCH: dict(profile=PROF.replace(budget=0.2)),
    R.STALE_GENERATION: dict(generation=2),
    R.TOKEN_MISMATCH: dict(swap=True),
    R.DIGEST_MISMATCH: dict(mutate=_corrupt),
    R.MISSING_SHARD: dict(mutate=_delete),
}


@pytest.mark.parametrize("reason", list(CASES), ids=lambda r: r.value)
def test_each_fallback_reason_recomputes_and_is_counted(setup, reason, tmp_path):
    m, docs, question, dirs, ref = setup
    case = CASES[reason]
    dirs = list(dirs)
    if "mutate" in case:
        import shutil
        shutil.copytree(dirs[1], tmp_path / "d1")
        dirs[1] = tmp_path / "d1"
        case["mutate"](dirs[1])
    if case.get("swap"):
        dirs[1], dirs[2] = dirs[2], dirs[1]
    counter = FallbackCounter()
    out = answer(m, case.get("profile", PROF), docs, dirs, question, case.get("ident", IDENT),
                 current_generation=case.get("generation", 1), counter=counter)
    assert out.arm == "recompute" and out.fell_back
    assert out.verdict.reason == reason, out.verdict
    assert counter.snapshot()[reason.value] == 1
    assert torch.equal(out.logits, ref)
