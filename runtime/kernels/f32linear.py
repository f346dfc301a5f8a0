"""Float32 projections of bf16 activations on the tensor cores (the compressors' `wkv` / `wgate`, float32 in the
reference): y = x @ w^T with x bf16 [T, K] and w float32 [N, K], as bf16 GEMMs with float32 output.

Each float32 weight splits exactly into three bf16 pieces, w = hi + mid + lo (8 of its 24 mantissa bits each;
`split3`), and x is bf16 already, so every product x_k * piece_k is exact in float32 and only the GEMMs' float32
accumulation rounds, as in the float32 GEMM the reference path runs (cuBLAS SGEMM on the CUDA cores). The tensor
cores' accumulation keeps fewer bits than the CUDA cores': against float64, 4.4e-6 relative where the float32 GEMM
gives 0.4-1.1e-6 (K = 4096, H200; `bench/f32linear.py`, `tests/kernels/test_f32linear_gpu.py`), a thousandth of
the bf16 rounding the compressed entries are stored with. One GEMM runs over the pieces of all the weights stacked
along N (one launch for kv and gate), in row chunks that bound its [rows, 3 x N] float32 output; each weight's
result sums its pieces small to large, (lo + mid) + hi.

    from runtime.kernels.f32linear import supported, linear_f32
    kv, gate = linear_f32(x, wkv.weight, wgate.weight)
"""
from __future__ import annotations

import torch

ROWS = 32768


def split3(w: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> bf16 [3, N, K]: hi, mid, lo with hi + mid + lo == w in float32, exactly for every w whose
    lowest piece is not subnormal (each difference below is exact: it keeps at most 16, then 8, significant bits)."""
    hi = w.to(torch.bfloat16)
    r = w - hi.float()
    mid = r.to(torch.bfloat16)
    return torch.stack([hi, mid, (r - mid.float()).to(torch.bfloat16)])


def supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """bf16 activations and float32 weights on one CUDA device, K a multiple of 8 (16-byte rows for cuBLAS)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] % 8 == 0
            and all(w.is_cuda and w.dtype == torch.float32 and w.dim() == 2 and w.shape[1] == x.shape[1]
                    for w in weights))


def linear_f32(x: torch.Tensor, *weights: torch.Tensor, rows: int = ROWS) -> tuple[torch.Tensor, ...]:
    """(x @ w^T for w in weights), each float32 [T, N_w] (column views of one [T, sum N_w] buffer), through the
    split bf16 GEMMs. Inference only: the result carries no autograd history (the model's forward runs under
    inference mode)."""
    if not supported(x, *weights):
        raise ValueError(f"linear_f32 takes bf16 x [T, K] and float32 weights [N, K] on CUDA, K % 8 == 0; got x "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}, weights "
                         f"{[(w.dtype, tuple(w.shape), str(w.device)) for w in weights]}")
    with torch.no_grad():
        return _linear_f32(x, weights, rows)


def kept_on_weights(weights, attr: str, make, extra=()):
    """`make()`, kept on weights[0] as `attr` and reused while the same weights are unchanged (their storage,
    version counters and shapes) and `extra` is equal: what is derived from a layer's weights is built once, not at
    every call; an in-place change of a weight (loading a checkpoint) makes it built again."""
    key = (tuple((id(w), w.data_ptr(), w._version, tuple(w.shape)) for w in weights), extra)
    kept = getattr(weights[0], attr, None)
    if kept is None or kept[0] != key:
        with torch.no_grad():
            kept = (key, make())
        setattr(weights[0], attr, kept)
    return kept[1]


def stacked_pieces(*weights: torch.Tensor) -> torch.Tensor:
    """bf16 [3 S, K]: the split3 pieces of all `weights` stacked along N (hi of all, mid of all, lo of all), kept
    on the first weight while the weights are unchanged (`kept_on_weights`), so a layer's weights are split once,
    not at every call (about ten launches each). Costs 1.5x the weights' float32 bytes of device memory while
    kept."""
    return kept_on_weights(weights, "_rk_pieces",
                           lambda: torch.cat([split3(w) for w in weights], dim=1).flatten(0, 1))


def _linear_f32(x, weights, rows):
    widths = [w.shape[0] for w in weights]
    S = sum(widths)
    pieces = stacked_pieces(*weights)                                      # [3 S, K]: hi of all, mid of all, lo
    x = x.contiguous()
    T = x.shape[0]
    full = x.new_empty((T, S), dtype=torch.float32)      # every weight's columns: (lo + mid) + hi in two launches
    for a in range(0, T, rows):
        b = min(a + rows, T)
        y = torch.mm(x[a:b], pieces.t(), out_dtype=torch.float32)          # [rows, 3 S]
        torch.add(y[:, 2 * S:], y[:, S:2 * S], out=full[a:b])
        full[a:b] += y[:, :S]
    starts = [sum(widths[:k]) for k in range(len(widths))]
    return tuple(full[:, c:c + n] for c, n in zip(starts, widths))
