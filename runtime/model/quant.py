"""The DeepSeek-V4 number formats, on CPU in plain torch: E8M0 power-of-two scales, FP8 e4m3 weights with
one scale per 128x128 block, FP4 e2m1 routed experts packed two per byte with one scale per 32 inputs, and a
simulation of the reference's dynamic FP8 activation quantization.

Every scale here is a power of two, so dequantization (code x 2^k) is exact in float32 and quantizing a
dequantized tensor again gives back the same codes and scales; the tests rely on that.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1 magnitude
E8M0_BIAS = 127
E8M0_NAN = 0xFF

# e2m1 code -> value; bit 3 is the sign, so codes 8..15 are 0..7 negated (8 is -0).
_E2M1_POS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = torch.tensor(_E2M1_POS + tuple(-v for v in _E2M1_POS), dtype=torch.float32)
# midpoints between consecutive magnitudes; a value exactly on one rounds to the even code (IEEE ties-to-even)
_E2M1_MIDS = torch.tensor([(a + b) / 2 for a, b in zip(_E2M1_POS, _E2M1_POS[1:])], dtype=torch.float32)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a one-byte tensor (uint8/int8/float8_e8m0fnu), as uint8."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1:
        raise TypeError(f"expected a one-byte dtype, got {t.dtype}")
    return t.view(torch.uint8)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 byte b -> 2^(b-127) as float32; 0xFF -> NaN. Built from float32 bit patterns so it is exact,
    including b = 0 (2^-127 is a float32 subnormal)."""
    b = _as_bytes(scale).to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)
    bits = torch.where(b == E8M0_NAN, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _exp_to_e8m0(exp: torch.Tensor) -> torch.Tensor:
    """Integer exponents (-127..127) -> E8M0 bytes (float8_e8m0fnu)."""
    assert exp.numel() == 0 or (int(exp.min()) >= -E8M0_BIAS and int(exp.max()) <= E8M0_BIAS)
    return (exp + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64 from its bit pattern (exact for -1022 <= e <= 1023)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _pow2_cover_exp(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """Smallest storable exponent e (-127..127) with amax <= limit * 2^e, as int32. frexp gives a first
    guess, off by at most one, that exact float64 comparisons correct."""
    amax = amax.double()
    if not torch.isfinite(amax).all():
        raise ValueError("cannot quantize a tensor holding inf or NaN")
    pos = amax > 0
    ratio = torch.where(pos, amax / limit, torch.ones_like(amax))
    mant, e = torch.frexp(ratio)  # ratio = mant * 2^e with mant in [0.5, 1)
    e = e.to(torch.int64)
    e = torch.where(mant == 0.5, e - 1, e)  # ratio is an exact power of two
    e = torch.where(amax > limit * _pow2_f64(e), e + 1, e)
    e = torch.where(amax <= limit * _pow2_f64(e - 1), e - 1, e)
    # an all-zero block gets scale 1: any scale reproduces zeros
    e = torch.where(pos, e, torch.zeros_like(e))
    # below 2^-127 a larger scale than needed is still safe: it only loses precision on tiny values
    return e.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _expand_blocks(s: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    """Broadcast a per-block grid to [rows, cols]; partial edge blocks reuse their block's entry."""
    return s.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]


def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """W[i, j] = e4m3(Wq[i, j]) * S[i // block, j // block], float32."""
    if w.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    want = (_ceil_div(rows, block), _ceil_div(cols, block))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} does not fit weight {tuple(w.shape)} "
                         f"with {block}x{block} blocks (want {want})")
    return w.to(torch.float32) * _expand_blocks(e8m0_to_float(scale), rows, cols, block, block)


def quant_fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/128), ceil(in/128)]) with the
    smallest power-of-two scale per block that keeps |w / s| <= 448 (so the e4m3 cast never saturates)."""
    if w.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    nr, nc = _ceil_div(rows, block), _ceil_div(cols, block)
    a = torch.zeros(nr * block, nc * block, dtype=torch.float32)
    a[:rows, :cols] = w.detach().to(torch.float32).abs()
    amax = a.view(nr, block, nc, block).amax(dim=(1, 3))
    scale = _exp_to_e8m0(_pow2_cover_exp(amax, FP8_MAX))
    s = _expand_blocks(e8m0_to_float(scale), rows, cols, block, block)
    return (w.detach().to(torch.float32) / s).to(torch.float8_e4m3fn), scale


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """I8/U8 [out, in/2] -> float32 [out, in]: byte k of a row holds element 2k in its low nibble and
    element 2k+1 in its high nibble."""
    if packed.dim() != 2:
        raise ValueError(f"packed FP4 weight must be 2-D, got shape {tuple(packed.shape)}")
    b = _as_bytes(packed)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(b.shape[0], b.shape[1] * 2)
    return E2M1_TABLE[codes.long()]


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """W[i, j] = e2m1(nibble(i, j)) * 2^(S[i, j // 32] - 127), float32."""
    vals = unpack_fp4(packed)
    rows, cols = vals.shape
    want = (rows, _ceil_div(cols, group))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not fit packed weight "
                         f"{tuple(packed.shape)} with groups of {group} (want {want})")
    return vals * _expand_blocks(e8m0_to_float(scale), rows, cols, 1, group)


def _round_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code for each value of x (|x| <= 6 assumed), ties to the even code, sign kept (also
    for values that round to zero, so -0.0 survives a round trip)."""
    a = x.abs()
    code = torch.bucketize(a, _E2M1_MIDS, right=False)  # a tie lands on the lower code
    tie_at = _E2M1_MIDS[code.clamp(max=len(_E2M1_MIDS) - 1)]
    code = torch.where((code < len(_E2M1_MIDS)) & (a == tie_at) & (code % 2 == 1), code + 1, code)
    return code + 8 * torch.signbit(x).long()


def quant_fp4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [out, in] -> (int8 [out, in/2] packed e2m1, float8_e8m0fnu [out, ceil(in/32)]), with the
    smallest power-of-two scale per 32 inputs that keeps max|w| / s <= 6, rounding to the nearest e2m1."""
    if w.dim() != 2 or w.shape[1] % 2:
        raise ValueError(f"FP4 weight must be 2-D with an even input dim, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    ng = _ceil_div(cols, group)
    wf = w.detach().to(torch.float32)
    a = torch.zeros(rows, ng * group, dtype=torch.float32)
    a[:, :cols] = wf.abs()
    scale = _exp_to_e8m0(_pow2_cover_exp(a.view(rows, ng, group).amax(dim=2), FP4_MAX))
    codes = _round_e2m1_codes(wf / _expand_blocks(e8m0_to_float(scale), rows, cols, 1, group))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale


_INV_FP8_MAX = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)


def fake_quant_fp8_act(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """What the reference's activation quantization does to x, as values in x's dtype: per 1x`block` slice of
    the last dim, amax (floored at 1e-4 like the reference kernel, so all-zero slices stay zero), scale
    s = 2^ceil(log2(amax * (1/448))) computed on float32 bits, then x -> e4m3(clamp(x / s, +-448)) * s.
    A last partial slice (dims that are not a multiple of `block`, as in test configs) gets its own scale."""
    n = x.shape[-1]
    nb = _ceil_div(n, block)
    xf = x.to(torch.float32)
    pad = nb * block - n
    xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
    xb = xp.reshape(*x.shape[:-1], nb, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
    # the reference multiplies by the float32 constant 1/448 and rounds the product's exponent up
    ratio_bits = (amax * _INV_FP8_MAX).view(torch.int32)
    exp = ((ratio_bits >> 23) & 0xFF) - E8M0_BIAS + ((ratio_bits & 0x7FFFFF) != 0).to(torch.int32)
    s = ((exp + E8M0_BIAS) << 23).view(torch.float32)
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s
    q = q.reshape(*x.shape[:-1], nb * block)
    return (q[..., :n] if pad else q).to(x.dtype)


FP8_ROW_BLOCK = 128  # channels per scale of a row-block-quantized tensor (`quant_fp8_rows`)


def quant_fp8_rows(x: torch.Tensor, block: int = FP8_ROW_BLOCK,
                   chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, C] -> (float8_e4m3fn codes [n, C], uint8 E8M0 exponents [n, ceil(C/block)]): one power-of-two scale per
    row and `block` channels, the smallest that covers the block's amax (`_pow2_cover_exp`, so no code saturates),
    codes rounded to nearest even from x / scale (exact: the scale is a power of two). Rows are quantized
    `chunk` at a time, so the float32 temporaries stay bounded on a long document."""
    assert x.dim() == 2, x.shape
    n, C = x.shape
    nb = _ceil_div(C, block)
    codes = torch.empty(n, C, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(n, nb, dtype=torch.uint8, device=x.device)
    pad = nb * block - C
    for a in range(0, n, chunk):
        xf = x[a:a + chunk].to(torch.float32)
        xb = (torch.nn.functional.pad(xf, (0, pad)) if pad else xf).view(-1, nb, block)
        exp = _pow2_cover_exp(xb.abs().amax(dim=2), FP8_MAX).to(xf.device)
        scales[a:a + chunk] = (exp + E8M0_BIAS).to(torch.uint8)
        s = e8m0_to_float(scales[a:a + chunk])
        codes[a:a + chunk] = (xb / s[..., None]).view(xf.shape[0], -1)[:, :C].to(torch.float8_e4m3fn)
    return codes, scales


def dequant_fp8_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     block: int = FP8_ROW_BLOCK) -> torch.Tensor:
    """The torch reference of a row-block dequantization: code x 2^(e-127) in float32 (exact), then `dtype`."""
    n, C = codes.shape
    s = e8m0_to_float(scales).repeat_interleave(block, dim=1)[:, :C]
    return (_as_bytes(codes).view(torch.float8_e4m3fn).to(torch.float32) * s).to(dtype)
