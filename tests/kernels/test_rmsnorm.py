"""runtime.kernels.rmsnorm (the one-pass RMS norm, weighted and unweighted) against the torch forms of RMSNorm.forward
and unweighted_rms_norm (the per-head query norm, 512 wide), on the GPU
(compiled) or, without one, under Triton's interpreter on CPU tensors: float32 rows to 1e-6 relative; bf16 rows
within one bf16 rounding step of the torch form (the float32 sum runs in another order, so a value on a rounding
boundary may round the other way) and, compiled, equal on >= 99% of elements (Triton 3.6's interpreter casts to bf16
by another rounding: about half the elements differ by that one step there); strided rows, 3-D input, a width that is
not a power of two; bad input refused. The whole-model interpreter and GPU tests run it inside every layer."""
import pytest
import torch

import runtime.kernels._triton as T
from runtime.kernels.rmsnorm import rms_norm, rms_norm_reference, supported

pytestmark = pytest.mark.skipif(not T.HAVE_TRITON or not (torch.cuda.is_available() or T.INTERPRET),
                                reason="needs Triton (compiled on a GPU, or its interpreter)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def case(shape, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(shape, device=DEV, generator=g) * 3 + 0.5).to(dtype)
    w = torch.rand(shape[-1], device=DEV, generator=g) + 0.5
    return x, w


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape", [(7, 4096), (33, 96), (5, 3, 1024), (9, 8, 512)])
def test_float32_equals_the_torch_form(shape, weighted):
    x, w = case(shape, torch.float32)
    w = w if weighted else None
    y, ref = rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert float((y - ref).norm() / ref.norm()) < 1e-6


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("shape", [(64, 4096), (129, 1024), (97, 8, 512)])
def test_bf16_within_one_rounding_step(shape, weighted):
    x, w = case(shape, torch.bfloat16, seed=1)
    w = w if weighted else None
    y, ref = rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert y.dtype == torch.bfloat16 and not torch.isnan(y).any()
    same = (y == ref).float().mean().item()
    # one bf16 ulp (8 significant bits); unweighted under the interpreter two: its other rounding of the cast
    # applies to the factor as well as to the product there
    steps = 1 if weighted or DEV == "cuda" else 2
    step = (ref.float().abs() * 2 ** -7).clamp_min(1e-30) * steps
    assert bool(((y.float() - ref.float()).abs() <= step).all())
    assert same >= (0.99 if DEV == "cuda" else 0.3 if weighted else 0.15), same


@pytest.mark.skipif(DEV != "cuda", reason="the dispatch runs the kernel on CUDA only")
def test_the_query_norm_dispatches_to_the_kernel():
    from runtime.model.deepseek_v4 import unweighted_rms_norm
    x, _ = case((300, 64, 512), torch.bfloat16, seed=3)
    y = unweighted_rms_norm(x, 1e-6)
    assert torch.equal(y, rms_norm(x, None, 1e-6))
    assert (y == rms_norm_reference(x, None, 1e-6)).float().mean().item() >= 0.99


def test_strided_rows():
    x, w = case((40, 2 * 512), torch.float32, seed=2)
    view = x[::2, :512]                                                # row stride 2048, last dim contiguous
    assert not view.is_contiguous() and supported(view, w[:512].contiguous())
    got = rms_norm(view, w[:512].contiguous(), 1e-5)
    assert float((got - rms_norm_reference(view, w[:512], 1e-5)).abs().max()) < 1e-5


def test_refuses_bad_input():
    x, w = case((4, 64), torch.float32)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rms_norm(x.t(), w, 1e-6)
    with pytest.raises(ValueError, match="float32 weight"):
        rms_norm(x, w[:32], 1e-6)
    with pytest.raises(ValueError, match="or None"):
        rms_norm(x.t(), None, 1e-6)
    assert not supported(x, w.bfloat16()) and not supported(x[:0], w)
