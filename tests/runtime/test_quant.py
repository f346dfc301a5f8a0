"""The DeepSeek-V4 number formats: E8M0 scales, FP8 e4m3 128x128 blocks, packed FP4 e2m1 experts, and the
simulated FP8 activation quantization. Expected values are written out by hand, not taken from the module."""
import math

import pytest
import torch

from runtime.model import quant

# e2m1 code -> value, as in DeepSeek's convert.py table; written out again so the test is independent
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def wide_range(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian rows whose magnitudes span 10^-4..10^4, so many different scales occur."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * 10 ** (torch.rand(rows, 1, generator=g) * 8 - 4)


# ---------------------------------------------------------------- E8M0


def test_e8m0_values_and_edges():
    b = torch.tensor([0, 1, 100, 126, 127, 128, 200, 254, 255], dtype=torch.uint8)
    got = quant.e8m0_to_float(b)
    assert got.dtype == torch.float32
    for byte, v in zip(b.tolist()[:-1], got.tolist()[:-1]):
        assert v == math.ldexp(1.0, byte - 127), byte  # exact, including the subnormal 2^-127
    assert math.isnan(got[-1].item())
    assert got[0].item() > 0  # 2^-127 must not flush to zero


def test_e8m0_accepts_float8_e8m0fnu_and_agrees_with_torch():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    as_f8 = b.view(torch.float8_e8m0fnu)
    ours = quant.e8m0_to_float(as_f8)
    assert torch.equal(bits(ours), bits(quant.e8m0_to_float(b)))
    theirs = as_f8.to(torch.float32)
    assert torch.equal(bits(ours[:255]), bits(theirs[:255]))
    assert torch.isnan(ours[255]) and torch.isnan(theirs[255])


def test_e8m0_rejects_wide_dtypes():
    with pytest.raises(TypeError):
        quant.e8m0_to_float(torch.zeros(3, dtype=torch.float32))


# ---------------------------------------------------------------- FP8 blocks


def test_dequant_fp8_block_hand_built_partial_blocks():
    # 130 x 3: two row blocks (the second holds 2 rows), one column block; every element e4m3 1.5
    w = torch.full((130, 3), 1.5).to(torch.float8_e4m3fn)
    scale = torch.tensor([[128], [125]], dtype=torch.uint8)  # 2^1, 2^-2
    out = quant.dequant_fp8_block(w, scale.view(torch.float8_e8m0fnu))
    assert out.dtype == torch.float32 and out.shape == (130, 3)
    assert torch.all(out[:128] == 3.0) and torch.all(out[128:] == 0.375)


def test_dequant_fp8_block_rejects_wrong_scale_shape():
    w = torch.zeros(130, 3).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale shape"):
        quant.dequant_fp8_block(w, torch.zeros(1, 1, dtype=torch.uint8))


@pytest.mark.parametrize("shape", [(300, 260), (64, 64), (1, 129)])
def test_quant_fp8_block_scales_are_minimal_powers_of_two(shape):
    w = wide_range(*shape, seed=1)
    q, s = quant.quant_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    sf = quant.e8m0_to_float(s)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max().item()
            assert blk <= 448 * sf[i, j].item() and blk > 224 * sf[i, j].item()  # half the scale overflows


def test_fp8_dequant_of_quant_round_trips_bit_exactly():
    for seed in range(4):
        w = wide_range(300, 260, seed)
        d = quant.dequant_fp8_block(*quant.quant_fp8_block(w))
        assert (d - w).abs().max() <= w.abs().max() / 16  # e4m3 keeps 3 mantissa bits
        again = quant.dequant_fp8_block(*quant.quant_fp8_block(d))
        assert torch.equal(bits(again), bits(d))


def test_quant_fp8_block_edges():
    w = torch.zeros(4, 4)
    w[0, 0] = 448.0
    q, s = quant.quant_fp8_block(w)
    assert s.view(torch.uint8).item() == 127 and q.float()[0, 0].item() == 448.0
    w[0, 0] = 449.0
    q, s = quant.quant_fp8_block(w)
    assert s.view(torch.uint8).item() == 128 and q.float()[0, 0].item() == 224.0
    q, s = quant.quant_fp8_block(torch.zeros(3, 5))  # an all-zero block: scale 1, zeros
    assert s.view(torch.uint8).item() == 127 and torch.all(q.float() == 0)
    with pytest.raises(ValueError, match="inf or NaN"):
        quant.quant_fp8_block(torch.tensor([[1.0, float("inf")]]))


# ---------------------------------------------------------------- FP4


def test_unpack_fp4_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    vals = quant.unpack_fp4(b)
    assert vals.shape == (16, 32) and vals.dtype == torch.float32
    for byte in range(256):
        r, c = divmod(byte, 16)
        lo, hi = vals[r, 2 * c].item(), vals[r, 2 * c + 1].item()
        assert lo == E2M1[byte & 0xF] and hi == E2M1[byte >> 4], byte
        assert math.copysign(1, lo) == math.copysign(1, E2M1[byte & 0xF])  # code 8 is -0
    # the checkpoint stores I8: the same bytes read as signed give the same values
    assert torch.equal(bits(quant.unpack_fp4(b.view(torch.int8))), bits(vals))


def test_unpack_fp4_nibble_order():
    # 0x71: low nibble 1 (0.5) is element 0, high nibble 7 (6.0) element 1; 0x9F: -6.0 then -0.5
    packed = torch.tensor([[0x71, 0x9F]], dtype=torch.uint8).view(torch.int8)
    assert quant.unpack_fp4(packed).tolist() == [[0.5, 6.0, -6.0, -0.5]]


def test_dequant_fp4_scales_per_32_inputs():
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8)  # every element code 2 = 1.0; 64 inputs per row
    scale = torch.tensor([[127, 130], [120, 127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    out = quant.dequant_fp4(packed.view(torch.int8), scale)
    assert out.shape == (2, 64)
    assert torch.all(out[0, :32] == 1.0) and torch.all(out[0, 32:] == 8.0)
    assert torch.all(out[1, :32] == 2.0 ** -7) and torch.all(out[1, 32:] == 1.0)
    with pytest.raises(ValueError, match="scale shape"):
        quant.dequant_fp4(packed, scale[:, :1])


def test_quant_fp4_packs_hand_values():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = 0.5, 6.0, -6.0, -0.5
    packed, scale = quant.quant_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (1, 16) and scale.shape == (1, 1)
    assert scale.view(torch.uint8).item() == 127
    assert packed.view(torch.uint8)[0, :2].tolist() == [0x71, 0x9F]


def test_quant_fp4_rounds_to_nearest_ties_to_even():
    # with scale 1 (amax 6): midpoints go to the even code, others to the nearest value
    x = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 2.6, 5.1, -0.74, -0.1]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 3.0, 6.0, -0.5, -0.0]
    w = torch.zeros(1, 32)
    w[0, :len(x)] = torch.tensor(x)
    got = quant.dequant_fp4(*quant.quant_fp4(w))[0, :len(x)]
    assert got.tolist() == want
    assert math.copysign(1, got[-1].item()) == -1  # a negative value rounding to zero keeps its sign


def test_fp4_dequant_of_quant_round_trips_bit_exactly():
    for seed in range(4):
        w = wide_range(40, 96, seed)
        packed, scale = quant.quant_fp4(w)
        assert scale.shape == (40, 3)
        sf = quant.e8m0_to_float(scale).repeat_interleave(32, dim=1)
        assert torch.all(w.abs() <= 6 * sf)
        d = quant.dequant_fp4(packed, scale)
        assert torch.all((d - w).abs() <= sf)  # half the largest e2m1 gap (2) times the scale
        again = quant.dequant_fp4(*quant.quant_fp4(d))
        assert torch.equal(bits(again), bits(d))


# ---------------------------------------------------------------- activations


def test_fake_quant_fp8_act_matches_blockwise_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=g) * torch.tensor([1e-3, 0.1, 1.0, 30.0, 1e4])[:, None]
    y = quant.fake_quant_fp8_act(x)
    for r in range(5):
        for blk in range(2):
            xs = x[r, blk * 128:(blk + 1) * 128]
            s = 2.0 ** math.ceil(math.log2(xs.abs().max().item() / 448))
            want = (xs / s).to(torch.float8_e4m3fn).float() * s
            assert torch.equal(y[r, blk * 128:(blk + 1) * 128], want)


def test_fake_quant_fp8_act_zeros_partial_blocks_and_dtype():
    assert torch.equal(quant.fake_quant_fp8_act(torch.zeros(2, 3, 200)), torch.zeros(2, 3, 200))
    x = torch.cat([torch.full((1, 128), 104.0), torch.full((1, 72), 1e-3 * 1.1)], dim=1)
    y = quant.fake_quant_fp8_act(x)
    # the 72-wide tail has its own scale: a shared one (from 104.0) would flush 1.1e-3 to zero
    assert torch.allclose(y[0, 128:], x[0, 128:], rtol=1 / 16)
    assert torch.all(y[0, :128] == 104.0)  # 104 / 2^-2 = 416 is an e4m3 value
    xb = torch.randn(4, 64).to(torch.bfloat16)
    yb = quant.fake_quant_fp8_act(xb)
    assert yb.dtype == torch.bfloat16 and torch.allclose(yb.float(), xb.float(), rtol=1 / 16, atol=0)
