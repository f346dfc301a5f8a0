"""The split mixing dots of runtime/kernels/mhc.py (`_hc_mix_kernel` with SPLIT, the default for bf16 streams) are
the float32 product of the reference, not an approximation of it: fn [24, hc*dim] (float32) is cut into three bf16
pieces, each rounded to nearest as the kernel's `.to(tl.bfloat16)` does, and every bf16 x bf16 product is exact in
float32. Checked here in float64 arithmetic on the CPU (Triton's interpreter has no bf16 dot); the kernel itself is
compared with a float64 reference on the GPU (tests/kernels/test_kernels_gpu.py `test_mhc_kernels_equal_model_hc`,
bf16) and compiled for sm_90 in CI (test_compile_sm90.py)."""
import pytest
import torch


def three_pieces(fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernel computes in registers: hi = bf16(fn), mid = bf16(fn - hi), lo = bf16(fn - hi - mid), each
    difference taken in float32."""
    hi = fn.to(torch.bfloat16)
    rest = fn - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return hi, mid, lo


@pytest.mark.parametrize("scale", [1e-20, 1e-3, (4 * 4096) ** -0.5, 1.0, 3e4])
def test_three_bf16_pieces_rebuild_float32_exactly(scale):
    """Exact for every float32 whose last piece stays a normal number (|fn| above ~2^-100; below, as for fn ~ 1e-33,
    the lowest bits of the last piece fall into subnormals)."""
    g = torch.Generator().manual_seed(7)
    fn = torch.randn(24, 16384, generator=g) * scale
    fn[0, :4] = torch.tensor([0.0, -0.0, 1.0 + 2 ** -23, -(1.0 - 2 ** -24)]) * scale
    hi, mid, lo = three_pieces(fn)
    rebuilt = hi.double() + mid.double() + lo.double()
    assert torch.equal(rebuilt, fn.double())


def test_split_products_are_the_float32_products():
    """x (bf16 values) times the pieces, summed in float64, is x times fn exactly: no product loses a bit, so the
    kernel's only rounding is float32 accumulation, as in the FMA dot and the torch path."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 1024, generator=g).to(torch.bfloat16)
    fn = torch.randn(24, 1024, generator=g) * 1024 ** -0.5
    hi, mid, lo = three_pieces(fn)
    xd = x.double()
    for piece in (hi, mid, lo):   # each bf16 x bf16 product fits float32's 24-bit mantissa
        prod = xd[:, None, :] * piece.double()[None, :, :]
        assert torch.equal(prod.float().double(), prod)
    split = sum(xd @ p.double().T for p in (hi, mid, lo))
    assert torch.allclose(split, xd @ fn.double().T, rtol=1e-12, atol=1e-12)


def test_split_dots_refuse_float32_streams():
    from runtime.kernels import mhc
    from runtime.kernels._triton import HAVE_TRITON
    if not HAVE_TRITON:
        pytest.skip("needs Triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3, 4, 64, device=dev)
    with pytest.raises(ValueError, match="bf16"):
        mhc.hc_pre(x, torch.randn(24, 256, device=dev), torch.zeros(24, device=dev), torch.ones(3, device=dev), 20,
                   1e-6, 1e-6, config=dict(SPLIT=True))
