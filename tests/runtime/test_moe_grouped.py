"""MoE.routed_grouped (the CUDA form: one torch._grouped_mm per weight, no host read) against MoE.routed_loop (the
reference: a gather and three GEMMs per expert) on CPU in float32, where torch._grouped_mm also runs: the same sum
to 1e-6 relative (only the GEMM kernels differ) with dropped slots, expert runs split across slot chunks, another
rank's experts (tensor parallelism), the SwiGLU clamp hit, and FP8 activation simulation. The stacked weights are
the experts' own storage, re-made when a weight is replaced."""
import pytest
import torch

from runtime.model.config import tiny
from runtime.model.deepseek_v4 import MoE, Transformer
from runtime.model.parallel import Parallel
from tests.tiny import tiny_model

TOL = 1e-6


def rel(a, b):
    return float((a - b).norm() / b.norm())


def routing(moe, T, drop, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, moe.gate.cfg.dim, generator=g) * 3
    w, idx = moe.gate(x, torch.randint(0, moe.gate.cfg.vocab_size, (T,), generator=g))
    if drop:
        idx = torch.where(torch.rand(idx.shape, generator=g) < drop, torch.full_like(idx, -1), idx)
    return x, w, idx


def layer(cfg, seed=3):
    m = tiny_model(cfg, seed=seed)
    return m.layers[cfg.n_layers - 1].ffn                        # a score-routed layer (past the hash layers)


@pytest.mark.parametrize("chunk", [7, 64, 32768])
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_grouped_equals_the_per_expert_loop(chunk, drop):
    cfg = tiny(n_layers=2, n_hash_layers=1)
    moe = layer(cfg)
    x, w, idx = routing(moe, 97, drop)
    want = moe.routed_loop(x, w, idx)
    got = moe.routed_grouped(x, w, idx, chunk=chunk)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel(got, want) < TOL
    assert ((idx < 0).any() if drop else (idx >= 0).all())


def test_grouped_clamp_and_fp8_simulation_are_applied():
    cfg = tiny(n_layers=2, n_hash_layers=1, quant_sim=True, swiglu_limit=0.5)
    moe = layer(cfg)
    x, w, idx = routing(moe, 64, 0.2)
    ex = moe.experts["0"]
    assert ex.w1.simulate and ex.limit == 0.5
    gate = ex.w1(x)
    assert (gate > 0.5).any()                                         # the clamp is hit on these rows
    want = moe.routed_loop(x, w, idx)
    assert rel(moe.routed_grouped(x, w, idx, chunk=16), want) < TOL
    ex.limit = 0.0                                                    # without the clamp the sum differs: it was active
    for e in moe.experts.values():
        e.limit = 0.0
    assert rel(moe.routed_grouped(x, w, idx), want) > 1e-3


def test_grouped_on_one_rank_of_two_sums_only_its_experts():
    cfg = tiny(n_layers=2, n_hash_layers=1)
    full = layer(cfg)
    half = MoE(cfg, 1, Parallel(rank=1, size=2), torch.float32)
    half.gate.load_state_dict(full.gate.state_dict())
    for e in half.local:
        half.experts[str(e)].load_state_dict(full.experts[str(e)].state_dict())
    assert list(half.local) != list(full.local)
    x, w, idx = routing(full, 80, 0.1)
    want = half.routed_loop(x, w, idx)
    assert want.abs().sum() > 0
    assert rel(half.routed_grouped(x, w, idx, chunk=50), want) < TOL


def test_stacks_are_the_experts_weights():
    cfg = tiny(n_layers=2, n_hash_layers=1)
    moe = layer(cfg)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    w1, w3, w2 = moe.stacks()
    assert all(torch.equal(before[k], v) for k, v in moe.state_dict().items())   # packing changed no value
    for i, e in enumerate(moe.local):
        ex = moe.experts[str(e)]
        assert ex.w1.weight.data_ptr() == w1[i].data_ptr() and ex.w2.weight.data_ptr() == w2[i].data_ptr()
    assert moe.stacks()[0] is w1                                      # kept while the weights are the same tensors
    x, w, idx = routing(moe, 50, 0.0)
    with torch.no_grad():
        moe.experts["1"].w3.weight.mul_(2)                             # an in-place change is seen by both forms
    assert rel(moe.routed_grouped(x, w, idx), moe.routed_loop(x, w, idx)) < TOL
    fresh = {k: v.clone() * 0.5 for k, v in moe.state_dict().items()}
    moe.load_state_dict(fresh, assign=True)                           # weights replaced: the stacks are re-made
    assert moe.stacks()[0] is not w1 and moe.stacks()[0][0].data_ptr() == moe.experts["0"].w1.weight.data_ptr()
    assert torch.equal(moe.stacks()[2][1], fresh["experts.1.w2.weight"])
    assert rel(moe.routed_grouped(x, w, idx), moe.routed_loop(x, w, idx)) < TOL


def test_routed_takes_the_loop_on_cpu():
    cfg = tiny(n_layers=2, n_hash_layers=1)
    moe = layer(cfg)
    x, w, idx = routing(moe, 30, 0.0)
    assert not moe.grouped_ok(x)
    assert torch.equal(moe.routed(x, w, idx), moe.routed_loop(x, w, idx))


def test_grouped_form_per_policy(monkeypatch):
    """The routed MoE takes the grouped form for calls of at most the policy's moe_grouped_slots (row, slot) pairs
    (the default 1 << 15) where it can run, the loop above; the model's set_policy reaches every MoE layer and
    policy_as restores the policy before."""
    from runtime.policy import RuntimePolicy
    cfg = tiny(n_layers=2, n_hash_layers=1)
    model = Transformer(cfg)
    moe = model.layers[1].ffn
    assert moe.policy.moe_grouped_slots == 1 << 15
    x, w, idx = routing(moe, 8, 0.0)
    took, real_loop = [], moe.routed_loop
    monkeypatch.setattr(moe, "grouped_ok", lambda x: True)
    monkeypatch.setattr(moe, "routed_grouped", lambda *a: took.append("grouped") or real_loop(*a))
    monkeypatch.setattr(moe, "routed_loop", lambda *a: took.append("loop") or real_loop(*a))
    moe.routed(x, w, idx)
    with model.policy_as(RuntimePolicy(moe_grouped_slots=idx.numel() - 1)):
        assert all(m.ffn.policy.moe_grouped_slots == idx.numel() - 1 for m in model.layers)
        moe.routed(x, w, idx)
    with model.policy_as(RuntimePolicy(moe_grouped_slots=idx.numel())):
        moe.routed(x, w, idx)
    assert took == ["grouped", "loop", "grouped"] and moe.policy == RuntimePolicy() == model.policy
