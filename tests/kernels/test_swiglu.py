"""runtime.kernels.swiglu (the experts' SwiGLU in one pass, from the projections' outputs to W_2's input) against
the torch form of Expert.activate with its casts, on the GPU (compiled) or, without one, under Triton's interpreter
on CPU tensors: float32 to 1e-6 relative; bf16 within one bf16 rounding step (exp and the float32 products may
round another way on a boundary) and, compiled, equal on >= 99% of elements; with and without the clamp and the
routing weights, rows strided, a width that is not a multiple of the block; bad input refused; and on the GPU the
model's experts take it."""
import pytest
import torch

import runtime.kernels._triton as T
from runtime.kernels.swiglu import supported, swiglu, swiglu_reference

pytestmark = pytest.mark.skipif(not T.HAVE_TRITON or not (torch.cuda.is_available() or T.INTERPRET),
                                reason="needs Triton (compiled on a GPU, or its interpreter)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def case(n, cols, dtype, seed=0, weighted=True):
    g = torch.Generator(device=DEV).manual_seed(seed)
    gate = (torch.randn(n, cols, device=DEV, generator=g) * 6).to(dtype)
    up = (torch.randn(n, cols, device=DEV, generator=g) * 6).to(dtype)
    w = torch.rand(n, 1, device=DEV, generator=g) if weighted else None
    return gate, up, w


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("limit", [7.0, 0.0])
def test_float32_equals_the_torch_form(weighted, limit):
    gate, up, w = case(37, 1500, torch.float32, weighted=weighted)
    got, ref = swiglu(gate, up, w, limit), swiglu_reference(gate, up, w, limit)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert float((got - ref).norm() / ref.norm()) < 1e-6
    if limit:                                        # the clamp is active: some inputs lie beyond it
        assert bool((gate.abs() > limit).any()) and bool((up.abs() > limit).any())


@pytest.mark.parametrize("weighted,limit", [(True, 7.0), (False, 0.0)])
def test_bf16_within_one_rounding_step(weighted, limit):
    gate, up, w = case(129, 2048, torch.bfloat16, seed=1, weighted=weighted)
    got, ref = swiglu(gate, up, w, limit), swiglu_reference(gate, up, w, limit)
    assert got.dtype == torch.bfloat16 and not torch.isnan(got).any()
    step = (ref.float().abs() * 2 ** -7).clamp_min(1e-30)              # one bf16 ulp (8 significant bits)
    assert bool(((got.float() - ref.float()).abs() <= step).all())
    same = (got == ref).float().mean().item()
    assert same >= (0.99 if DEV == "cuda" else 0.2), same


def test_strided_rows_and_the_output_dtype():
    gate, up, w = case(20, 2 * 300, torch.bfloat16, seed=2)
    g, u = gate[:, :300], up[:, 300:]                 # row stride 600, columns contiguous
    assert not g.is_contiguous() and supported(g, u, w)
    got = swiglu(g, u, w, 7.0, torch.float32)
    ref = swiglu_reference(g, u, w, 7.0, torch.float32)
    assert got.dtype == torch.float32 and float((got - ref).abs().max() / ref.abs().max()) < 1e-6


def test_refuses_bad_input():
    gate, up, w = case(4, 64, torch.float32)
    with pytest.raises(ValueError, match="one shape"):
        swiglu(gate, up[:, :32], w, 0.0)
    with pytest.raises(ValueError, match="weights"):
        swiglu(gate, up, w[:2], 0.0)
    assert not supported(gate.t(), up.t(), None) and not supported(gate, up.bfloat16(), None)
    assert not supported(gate, up, w.bfloat16())


@pytest.mark.skipif(DEV != "cuda", reason="the experts dispatch to the kernel on CUDA only")
def test_the_experts_take_the_kernel(monkeypatch):
    from runtime.model.deepseek_v4 import Expert
    import runtime.kernels.swiglu as S
    calls = []
    kern = S._swiglu_kernel
    monkeypatch.setattr(S, "_swiglu_kernel", type("Spy", (), {"__getitem__": lambda self, grid:
                                                                 calls.append(grid) or kern[grid]})())
    torch.manual_seed(0)
    ex = Expert(256, 512, torch.bfloat16, 7.0, False).to(DEV)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(300, 256, device=DEV).bfloat16()
    w = torch.rand(300, 1, device=DEV)
    got = ex(x, w)
    ref = ex.w2(ex.activate(ex.w1(x).float(), ex.w3(x).float(), w).to(x.dtype))
    assert len(calls) == 1
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
