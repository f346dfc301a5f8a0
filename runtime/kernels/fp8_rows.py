"""Gather rows of a row-block FP8 tensor and dequantize them in one pass: the restore of a Local contribution
stored in FP8 (`ReuseProfile.local_format = "fp8"`, `runtime.model.quant.quant_fp8_rows`).

    gather_dequant_rows(codes, scales, code_ids, scale_ids, out)

codes [R, C] float8_e4m3fn (or its bytes as uint8), scales [R', ceil(C/128)] uint8 E8M0 exponents; out[r] =
codes[code_ids[r]] x 2^(scales[scale_ids[r]] - 127) per 128 channels, computed in float32 (exact: the scale is a
power of two) and written in out's dtype. Two row ids because a staged layer's codes and scales are two views of
one buffer with different row widths (`views.rows_view`). On CUDA one Triton program per (row, channel
block), decoding e4m3 from its bits; elsewhere the torch reference (`runtime.model.quant.dequant_fp8_rows`).
"""
from __future__ import annotations

import torch

from runtime.model.quant import FP8_ROW_BLOCK, dequant_fp8_rows
from . import _triton                          # `_triton.enabled`: the one switch, read at call time
from ._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:

    @triton.jit
    def _gather_dequant_kernel(codes_ptr, scales_ptr, cid_ptr, sid_ptr, out_ptr, C, stride_c, stride_s, stride_o,
                               BLOCK_C: tl.constexpr, QBLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = cols < C
        src = tl.load(cid_ptr + r).to(tl.int64)
        srow = tl.load(sid_ptr + r).to(tl.int64)
        b = tl.load(codes_ptr + src * stride_c + cols, mask=mask, other=0).to(tl.int32)
        e = tl.load(scales_ptr + srow * stride_s + cols // QBLOCK, mask=mask, other=127).to(tl.int32)
        ex = (b >> 3) & 0xF
        mant = b & 0x7
        # e4m3: normal (8 + m) * 2^(ex - 10) has float32 bits (ex + 120) << 23 | m << 20; subnormal m * 2^-9
        normal = ((ex + 120) << 23 | (mant << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(ex == 0, mant.to(tl.float32) * 0.001953125, normal)
        val = tl.where((b & 0x80) != 0, -mag, mag)
        # E8M0: 2^(e - 127) has float32 bits e << 23, and 2^-127 (e = 0) the subnormal 1 << 22
        scale = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
        tl.store(out_ptr + r * stride_o + cols, (val * scale).to(out_ptr.dtype.element_ty), mask=mask)


def gather_dequant_reference(codes, scales, code_ids, scale_ids, out: torch.Tensor) -> torch.Tensor:
    rows = codes.view(torch.uint8).index_select(0, code_ids)
    out.copy_(dequant_fp8_rows(rows, scales.index_select(0, scale_ids), out.dtype))
    return out


def gather_dequant_rows(codes: torch.Tensor, scales: torch.Tensor, code_ids: torch.Tensor, scale_ids: torch.Tensor,
                        out: torch.Tensor) -> torch.Tensor:
    """out[r] = dequant(codes[code_ids[r]], scales[scale_ids[r]]); returns out."""
    n, C = out.shape
    assert codes.dim() == 2 and codes.shape[1] == C and codes.element_size() == 1, (codes.shape, codes.dtype)
    assert scales.dtype == torch.uint8 and scales.shape[1] == -(-C // FP8_ROW_BLOCK), (scales.shape, C)
    assert code_ids.shape == (n,) and scale_ids.shape == (n,), (code_ids.shape, scale_ids.shape, n)
    if not _triton.enabled(out):
        return gather_dequant_reference(codes, scales, code_ids, scale_ids, out)
    assert codes.device == scales.device == code_ids.device == scale_ids.device == out.device
    assert out.stride(1) == 1 and codes.stride(1) == 1 and scales.stride(1) == 1
    if n == 0:
        return out
    block = 1024
    _gather_dequant_kernel[(n, triton.cdiv(C, block))](
        codes.view(torch.uint8), scales, code_ids, scale_ids, out, C, codes.stride(0),
        scales.stride(0), out.stride(0), BLOCK_C=block, QBLOCK=FP8_ROW_BLOCK, num_warps=4)
    return out
