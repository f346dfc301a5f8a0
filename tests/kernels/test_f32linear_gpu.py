"""runtime.kernels.f32linear on CUDA: the split bf16 GEMMs against a float64 product of the same bf16 rows and
float32 weights, relative error below 1e-5, at the compressors' shapes, with row chunks and widths that do not
divide evenly; and the compressor's projection takes it. The products are exact; the tensor cores' float32
accumulation keeps fewer bits than the CUDA cores' (H200: 4.4e-6 against the float32 GEMM's 0.4-1.1e-6), a
thousandth of the bf16 rounding (3.9e-3) that the compressed entries are stored with. Skipped without CUDA (CPU CI:
tests/kernels/test_f32linear_split.py)."""
import pytest
import torch
import torch.nn.functional as F

from runtime.kernels import available

pytestmark = pytest.mark.skipif(not available(), reason="needs Triton and a CUDA device")


def rel(y, r):
    return float((y.double() - r).norm() / r.norm())


@pytest.mark.parametrize("T,widths,rows", [(3001, (1024, 1024), 1000), (4096, (512, 512), 32768),
                                           (777, (256, 256, 40), 300)])
def test_split_gemm_is_as_close_to_float64_as_the_float32_gemm(T, widths, rows):
    from runtime.kernels.f32linear import linear_f32
    g = torch.Generator(device="cuda").manual_seed(T)
    ws = [torch.randn(n, 4096, device="cuda", generator=g) * 4096 ** -0.5 for n in widths]
    x = (torch.randn(T, 4096, device="cuda", generator=g) * 3).bfloat16()
    ys = linear_f32(x, *ws, rows=rows)
    for y, w in zip(ys, ws):
        ref = x.double() @ w.double().t()
        # the outputs are column blocks of one [T, sum(widths)] buffer (the sums are assembled in two launches)
        assert y.dtype == torch.float32 and y.shape == (T, w.shape[0]) and y.stride() == (sum(widths), 1)
        assert y.untyped_storage().data_ptr() == ys[0].untyped_storage().data_ptr()
        assert not torch.isnan(y).any()
        e, e32 = rel(y, ref), rel(F.linear(x.float(), w), ref)
        assert e < 1e-5 and e32 < 1e-6, (e, e32)


def test_compressor_projection_takes_the_split_gemm():
    from runtime.model.config import FLASH
    import runtime.kernels.f32linear as f32linear
    calls = []
    real = f32linear.linear_f32

    def spy(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)
    f32linear.linear_f32 = spy
    try:
        from runtime.model.deepseek_v4 import Transformer
        cfg = FLASH.replace(n_layers=3, compress_ratios=(0, 4, 128), n_hash_layers=1, n_routed_experts=8,
                            vocab_size=512)
        with torch.device("cuda"):
            m = Transformer(cfg, dtype=torch.bfloat16)
        comp = next(layer.attn.compressor for layer in m.layers if layer.attn.compressor is not None)
        for p in comp.parameters():
            p.data.normal_(0, 0.02)
        x = torch.randn(256, cfg.dim, device="cuda").bfloat16()
        kv, gate = comp.project(x)
        ref = F.linear(x.float(), comp.wkv.weight)
        assert calls == [(256, cfg.dim)] and rel(kv, ref.double()) < 1e-5
        assert rel(gate, F.linear(x.float(), comp.wgate.weight).double()) < 1e-5
    finally:
        f32linear.linear_f32 = real
