"""mHC residual mixing in Triton: `hc_pre` (mixing weights, Sinkhorn, stream collapse) and `hc_post` (new streams).

    pre, post, comb, collapsed = hc_pre(x, fn, base, scale, iters, hc_eps, norm_eps)
    new_x = hc_post(y, x, post, comb)

Both run on every row of every layer in both arms and are memory-bound: x is [T, hc, dim] (hc = 4 streams of
4096 channels, 32 KiB per row in bf16). The torch path (runtime/model/deepseek_v4.py `hc_mix_weights`,
`Block.hc_pre`, `Block.hc_post`) converts x to float32 for a 24-column GEMM, runs Sinkhorn as ~80 launches over
[T, 4, 4], and forms comb^T @ x as a batched 4x4 matmul for which cuBLAS picks a 16x16-tile kernel; on the H200 the
two took about a third of the reuse arm's time at 32K (docs/BENCHMARKS.md, run 6). Here:

- `_hc_mix_kernel`: per block of rows, one pass over x: the row's sum of squares and x @ fn^T (float32 operands,
  full float32 products), scaled by the row's rsqrt(mean(x^2) + eps) at the end (the reference scales first; the
  two differ by float32 rounding). For bf16 streams (the model's dtype on GPU) fn is split in registers into three
  bf16 pieces (hi + mid + lo = fn exactly) and the product runs as three tensor-core dots, every bf16 x bf16
  product exact in float32; each K block's dots start from zero and are added to a float32 accumulator on the
  CUDA cores (the tensor cores' own accumulation keeps fewer bits). 3.2e-7 from float64 against the FMA dot's
  2.3e-6, and 0.9 ms instead of ~10 ms per 64K-row call on the H200, 59% of the copy rate (docs/BENCHMARKS.md
  run 9, bench/mhc.py). float32 streams keep the FMA dot;
- `_hc_weights_kernel`: per block of rows, pre/post sigmoids and the 20 Sinkhorn iterations in registers, then the
  collapse sum_i pre_i x_i over dim in float32, cast once to x's dtype (as the reference);
- `_hc_post_kernel`: post_i y + sum_j comb_ji x_j in float32, cast once to x's dtype (the torch path rounds the
  matmul and the product to bf16 separately before adding; in float32 the two agree to rounding).

On CPU, without Triton, or with REDKNOT_KERNELS=0, the model's torch path runs (callers check `enabled`).
"""
from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, check_runnable, tl, triton

if HAVE_TRITON:

    @triton.jit
    def _hc_mix_kernel(x_ptr, fn_ptr, mix_ptr, T, K, norm_eps, MIX: tl.constexpr, MIXP: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        rmask = rows < T
        cols = tl.arange(0, MIXP)
        cmask = cols < MIX
        acc = tl.zeros((BT, MIXP), dtype=tl.float32)
        ssq = tl.zeros((BT,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < K
            xk = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            xf = xk.to(tl.float32)
            ssq += tl.sum(xf * xf, axis=1)
            fk = tl.load(fn_ptr + cols[None, :] * K + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
            if SPLIT:
                # x is bf16: fn = hi + mid + lo in three bf16 pieces (8 bits of fn's 24-bit mantissa each, the
                # rest carried down), so each bf16 x bf16 product on the tensor cores is exact in float32. The
                # tensor cores' own accumulation keeps fewer bits than float32 (a whole-K chain measured 5e-5
                # from float64 on the H200, against 2e-6 for the FMA dot), so each K block's three dots start from
                # zero and their sum is added to the float32 accumulator on the CUDA cores
                hi = fk.to(tl.bfloat16)
                rest = fk - hi.to(tl.float32)
                mid = rest.to(tl.bfloat16)
                lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
                part = tl.dot(xk, lo)
                part = tl.dot(xk, mid, part)
                acc += tl.dot(xk, hi, part)
            else:
                acc = tl.dot(xf, fk, acc, input_precision="ieee")
        r = 1.0 / tl.sqrt(ssq / K + norm_eps)
        tl.store(mix_ptr + rows[:, None] * MIX + cols[None, :], acc * r[:, None],
                 mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _hc_weights_kernel(x_ptr, mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, out_ptr, T, D,
                           iters, hc_eps, HC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        MIX: tl.constexpr = (2 + HC) * HC
        rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        rmask = rows < T
        h = tl.arange(0, HC)
        hh = tl.arange(0, HC * HC)
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        m2 = rmask[:, None] & (h[None, :] < HC)
        mpre = tl.load(mix_ptr + rows[:, None] * MIX + h[None, :], mask=m2, other=0.0)
        pre = tl.sigmoid(mpre * s0 + tl.load(base_ptr + h)[None, :]) + hc_eps
        mpost = tl.load(mix_ptr + rows[:, None] * MIX + HC + h[None, :], mask=m2, other=0.0)
        post = 2.0 * tl.sigmoid(mpost * s1 + tl.load(base_ptr + HC + h)[None, :])
        tl.store(pre_ptr + rows[:, None] * HC + h[None, :], pre, mask=m2)
        tl.store(post_ptr + rows[:, None] * HC + h[None, :], post, mask=m2)
        # comb[t, a, b] = mixes[2 HC + a HC + b]: softmax over b, + eps, then columns (over a), rows, columns...
        m3 = rmask[:, None] & (hh[None, :] < HC * HC)
        mc = tl.load(mix_ptr + rows[:, None] * MIX + 2 * HC + hh[None, :], mask=m3, other=0.0)
        c = tl.reshape(mc * s2 + tl.load(base_ptr + 2 * HC + hh)[None, :], (BT, HC, HC))
        c = tl.exp(c - tl.max(c, axis=2, keep_dims=True))
        c = c / tl.sum(c, axis=2, keep_dims=True) + hc_eps
        c = c / (tl.sum(c, axis=1, keep_dims=True) + hc_eps)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=2, keep_dims=True) + hc_eps)
            c = c / (tl.sum(c, axis=1, keep_dims=True) + hc_eps)
        tl.store(comb_ptr + rows[:, None] * (HC * HC) + hh[None, :], tl.reshape(c, (BT, HC * HC)), mask=m3)
        # collapse: sum_i pre_i x[t, i, :]
        for d0 in range(0, D, BD):
            ds = d0 + tl.arange(0, BD)
            dmask = ds < D
            x3 = tl.load(x_ptr + rows[:, None, None] * (HC * D) + h[None, :, None] * D + ds[None, None, :],
                         mask=rmask[:, None, None] & dmask[None, None, :], other=0.0).to(tl.float32)
            o = tl.sum(pre[:, :, None] * x3, axis=1)
            tl.store(out_ptr + rows[:, None] * D + ds[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=rmask[:, None] & dmask[None, :])

    @triton.jit
    def _hc_post_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, yrow_ptr, orow_ptr, T, D, HC: tl.constexpr,
                        BT: tl.constexpr, BD: tl.constexpr, Y_ROWS: tl.constexpr, OUT_ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        ds = tl.program_id(1) * BD + tl.arange(0, BD)
        rmask = rows < T
        dmask = ds < D
        h = tl.arange(0, HC)
        m2 = rmask[:, None] & dmask[None, :]
        yr = rows
        if Y_ROWS:                     # row t's block output is row yrow[t] of y (y in another row order)
            yr = tl.load(yrow_ptr + rows, mask=rmask, other=0).to(tl.int64)
        orow = rows
        if OUT_ROWS:                   # row t's new streams go to row orow[t] of out (written in place)
            orow = tl.load(orow_ptr + rows, mask=rmask, other=0).to(tl.int64)
        y = tl.load(y_ptr + yr[:, None] * D + ds[None, :], mask=m2, other=0.0).to(tl.float32)
        x3 = tl.load(x_ptr + rows[:, None, None] * (HC * D) + h[None, :, None] * D + ds[None, None, :],
                     mask=rmask[:, None, None] & dmask[None, None, :], other=0.0).to(tl.float32)
        for i in tl.static_range(HC):
            p = tl.load(post_ptr + rows * HC + i, mask=rmask, other=0.0)
            cj = tl.load(comb_ptr + rows[:, None] * (HC * HC) + h[None, :] * HC + i,
                         mask=rmask[:, None], other=0.0)                       # comb[t, j, i] over j
            o = p[:, None] * y + tl.sum(cj[:, :, None] * x3, axis=1)
            tl.store(out_ptr + orow[:, None] * (HC * D) + i * D + ds[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=m2)


def supported(x: torch.Tensor) -> bool:
    """The kernels take [T, hc, dim] streams with hc a power of two (DeepSeek-V4: 4)."""
    hc = x.shape[1] if x.dim() == 3 else 0
    return hc > 0 and hc & (hc - 1) == 0


def mix_config(dtype: torch.dtype) -> dict:
    """`_hc_mix_kernel`'s launch configuration: bf16 x takes the split tensor-core dots (SPLIT) on 128-row tiles;
    other dtypes the float32 FMA dot."""
    if dtype == torch.bfloat16:
        return dict(BT=128, BK=64, SPLIT=True, num_warps=8, num_stages=3)
    return dict(BT=32, BK=64, SPLIT=False, num_warps=4, num_stages=2)


def hc_mix(x: torch.Tensor, fn: torch.Tensor, norm_eps: float, config: dict | None = None) -> torch.Tensor:
    """x [T, hc, dim] -> mixes [T, (2 + hc) hc] float32: each row's x @ fn^T scaled by rsqrt(mean(x^2) + eps), one
    launch (`hc_pre`'s first). `config`: launch configuration over `mix_config`'s (bench/mhc.py sweeps it; SPLIT
    needs bf16 x)."""
    if (config or {}).get("SPLIT") and x.dtype != torch.bfloat16:
        raise ValueError(f"the split mixing dots need bf16 streams, got {x.dtype}")
    check_runnable(x)
    assert supported(x), x.shape
    x = x.contiguous()
    T, hc, D = x.shape
    mix = (2 + hc) * hc
    assert fn.shape == (mix, hc * D), fn.shape
    mixes = torch.empty((T, mix), dtype=torch.float32, device=x.device)
    if T == 0:
        return mixes
    cfg = dict(mix_config(x.dtype), **(config or {}))
    _hc_mix_kernel[(triton.cdiv(T, cfg["BT"]),)](x, fn.float().contiguous(), mixes, T, hc * D, norm_eps, MIX=mix,
                                                MIXP=max(16, triton.next_power_of_2(mix)), **cfg)
    return mixes


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
           norm_eps: float, config: dict | None = None):
    """x [T, hc, dim] -> (collapsed [T, dim] in x's dtype, pre [T, hc], post [T, hc], comb [T, hc, hc]) float32:
    `hc_mix_weights` and the collapse of `Block.hc_pre` in two launches. `config`: the mixing kernel's (`hc_mix`)."""
    mixes = hc_mix(x, fn, norm_eps, config)
    assert iters >= 1, iters
    x = x.contiguous()
    T, hc, D = x.shape
    assert base.shape == (mixes.shape[1],) and scale.numel() == 3, (base.shape, scale.shape)
    dev = x.device
    pre = torch.empty((T, hc), dtype=torch.float32, device=dev)
    post = torch.empty((T, hc), dtype=torch.float32, device=dev)
    comb = torch.empty((T, hc, hc), dtype=torch.float32, device=dev)
    out = torch.empty((T, D), dtype=x.dtype, device=dev)
    if T == 0:
        return out, pre, post, comb
    bw = 16
    _hc_weights_kernel[(triton.cdiv(T, bw),)](x, mixes, base.float().contiguous(), scale.float().contiguous(), pre,
                                              post, comb, out, T, D, iters, hc_eps, HC=hc, BT=bw,
                                              BD=min(256, triton.next_power_of_2(D)), num_warps=4)
    return out, pre, post, comb


def hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            y_rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
            out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """post_i * y + sum_j comb[j, i] x_j for every stream i: `Block.hc_post` in one launch, in x's dtype. With
    `y_rows` [T], row t's block output is y[y_rows[t]] (y in another row order, read where it lies); with `out` and
    `out_rows` [T], row t's new streams are written into out[out_rows[t]] and out is returned (the caller's
    row-wise replacement, without a copy of the result first)."""
    check_runnable(x)
    assert supported(x), x.shape
    T, hc, D = x.shape
    assert y.dim() == 2 and y.shape[1] == D and (y_rows is not None or y.shape[0] == T), (y.shape, x.shape)
    assert post.shape == (T, hc) and comb.shape == (T, hc, hc), (post.shape, comb.shape)
    assert (out is None) == (out_rows is None), "out and out_rows come together"
    for r in (y_rows, out_rows):
        assert r is None or (r.shape == (T,) and r.device == x.device and not r.is_floating_point()), r
    x, y = x.contiguous(), y.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    if out is None:
        out = torch.empty_like(x)
    else:
        assert out.dim() == 3 and out.shape[1:] == x.shape[1:] and out.dtype == x.dtype and out.is_contiguous(), \
            (out.shape, out.dtype)
    if T == 0:
        return out
    bt, bd = 16, min(128, triton.next_power_of_2(D))
    _hc_post_kernel[(triton.cdiv(T, bt), triton.cdiv(D, bd))](
        y, x, post, comb, out, x if y_rows is None else y_rows.contiguous(),
        x if out_rows is None else out_rows.contiguous(), T, D, HC=hc, BT=bt, BD=bd, Y_ROWS=y_rows is not None,
        OUT_ROWS=out_rows is not None, num_warps=4)
    return out
