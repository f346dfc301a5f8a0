"""MoE.routed on CUDA, for a call within the policy's moe_grouped_slots, takes the grouped form (torch._grouped_mm, no
host read); against the per-expert loop run in float32 on the upcast weights and inputs, within the bf16 tolerance of METHOD.md
(1e-2 relative, NaN never passes), with dropped slots and expert runs split across slot chunks. Skipped without CUDA
(CPU CI runs tests/runtime/test_moe_grouped.py, the same comparison in float32)."""
import copy

import pytest
import torch

from runtime.kernels import available

pytestmark = pytest.mark.skipif(not available(), reason="needs Triton and a CUDA device")

TOL = 1e-2


@pytest.mark.parametrize("chunk", [1000, 32768])
@pytest.mark.parametrize("drop", [0.0, 0.4])
def test_grouped_moe_matches_the_float32_loop(chunk, drop, monkeypatch):
    from runtime.model.config import FLASH
    from runtime.model.deepseek_v4 import MoE, Parallel
    cfg = FLASH.replace(dim=1024, moe_inter_dim=512, n_routed_experts=16)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"):
        moe = MoE(cfg, cfg.n_hash_layers, Parallel(), torch.bfloat16)
    for p in moe.parameters():
        p.data.normal_(0, p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1, generator=g)
    ref = copy.deepcopy(moe).float()
    T = 3001
    x = torch.randn(T, cfg.dim, device="cuda", generator=g).bfloat16()
    with torch.inference_mode():
        w, idx = moe.gate(x, torch.zeros(T, dtype=torch.long, device="cuda"))
        if drop:
            idx = torch.where(torch.rand(idx.shape, device="cuda", generator=g) < drop, -1, idx)
        assert moe.grouped_ok(x)
        got = moe.routed_grouped(x, w, idx, chunk=chunk)
        via = moe.routed(x, w, idx)
        want = ref.routed_loop(x.float(), w, idx)
    assert not torch.isnan(got).any()
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err < TOL, f"rel err {err:.2e}"
    assert float((via.double() - want.double()).norm() / want.double().norm()) < TOL


def _small_routed_call():
    """A small bf16 MoE on CUDA and one routed call's inputs (x, weights, ids), every fifth slot dropped (-1)."""
    from runtime.model.config import FLASH
    from runtime.model.deepseek_v4 import MoE, Parallel
    cfg = FLASH.replace(dim=256, moe_inter_dim=128, n_routed_experts=8)
    with torch.device("cuda"):
        moe = MoE(cfg, cfg.n_hash_layers, Parallel(), torch.bfloat16)
    x = torch.randn(500, cfg.dim, device="cuda").bfloat16()
    with torch.inference_mode():
        w, idx = moe.gate(x, torch.zeros(500, dtype=torch.long, device="cuda"))
        idx = torch.where(torch.arange(idx.numel(), device="cuda").view_as(idx) % 5 == 0, -1, idx)
    return moe, x, w, idx


def test_grouped_moe_never_waits_for_the_gpu():
    """No host read in the grouped form (its expert runs are counted on the device): under torch's sync debug mode
    "error" any synchronizing call would raise."""
    moe, x, w, idx = _small_routed_call()
    with torch.inference_mode():
        moe.stacks()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = moe.routed_grouped(x, w, idx, chunk=128)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        want = moe.routed_loop(x, w, idx)
    assert ((got - want).norm() / want.norm()).item() < TOL


def test_the_loop_reads_the_expert_counts_once():
    """routed_loop's one host read (the expert counts) is its only sync: found with bench/syncs.py."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.syncs import find_syncs
    moe, x, w, idx = _small_routed_call()
    with torch.inference_mode():
        got, seen, _ = find_syncs(lambda: moe.routed_loop(x, w, idx), depth=1)
        want = moe.routed_grouped(x, w, idx)
    assert list(seen.values()) == [1] and "routed_loop" in next(iter(seen)), seen
    assert ((got - want).norm() / want.norm()).item() < TOL
