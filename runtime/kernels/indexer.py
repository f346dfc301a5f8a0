"""Lightning-indexer scoring and top-k at long context: runtime/model/deepseek_v4.py `Indexer.scores` followed by
`topk` (as in `Indexer.forward`), without the [T, IH, N] score block.

    score[t, s] = ID^-0.5 * sum_h w[t, h] * relu(q[t, h] . key[s])      for s < (cpos[t] + 1) // ratio
                = -inf                                                  otherwise

`w` is the already scaled head weight (weights_proj(x) * IH^-0.5). The scoring kernel tiles [BLOCK_T rows x
BLOCK_N entries], keeps the key tile on chip, loops over the IH heads with one [BLOCK_T, ID] x [ID, BLOCK_N]
product each and reduces the heads in registers, so only the [T, N] float32 scores reach memory; tiles wholly
past every row's causal limit are written as -inf without any product. Top-k then runs with torch.topk over
row chunks of the score matrix (a bounded [T_chunk, N] buffer).
"""
from __future__ import annotations

import torch

from ._host import aligned, to_device_nowait
from ._triton import HAVE_TRITON, check_runnable, dot_precision, tl, triton

if HAVE_TRITON:
    from ._triton import table_ptr

if HAVE_TRITON:

    @triton.jit
    def _score_tile(q_ptr, w_ptr, kt, offs_t, tmask, offs_d, offs_n, ready, scale, stride_qt, stride_qh, stride_wt,
                    IH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        """One [BLOCK_T, BLOCK_N] tile of scores against the key tile kt [ID, BLOCK_N], the heads reduced in
        registers; -inf past each row's `ready` entries."""
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for h in range(IH):
            base = q_ptr + offs_t[:, None] * stride_qt + h * stride_qh
            qh = tl.load(base + offs_d[None, :], mask=tmask[:, None], other=0.0)   # [BLOCK_T, ID]
            s = tl.dot(qh, kt, input_precision=PREC)
            wh = tl.load(w_ptr + offs_t * stride_wt + h, mask=tmask, other=0.0)
            acc += wh[:, None] * tl.maximum(s, 0.0)
        return tl.where(offs_n[None, :] < ready[:, None], acc * scale, float("-inf"))

    @triton.jit
    def _indexer_scores_kernel(q_ptr, k_ptr, w_ptr, cpos_ptr, o_ptr, T, N, ratio, scale,
                               stride_qt, stride_qh, stride_wt, stride_ot,
                               IH: tl.constexpr, ID: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                               PREC: tl.constexpr):
        pid_n = tl.program_id(0)                  # entries fastest: programs of one row block run together
        pid_t = tl.program_id(1)
        offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        tmask = offs_t < T
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_d = tl.arange(0, ID)
        cp = tl.load(cpos_ptr + offs_t, mask=tmask, other=-1).to(tl.int32)
        ready = tl.maximum(cp + 1, 0) // ratio                            # entries complete before row t
        if n0 < tl.max(ready, 0):
            kt = tl.load(k_ptr + offs_n[None, :].to(tl.int64) * ID + offs_d[:, None], mask=nmask[None, :],
                         other=0.0)                                      # [ID, BLOCK_N]
            res = _score_tile(q_ptr, w_ptr, kt, offs_t, tmask, offs_d, offs_n, ready, scale, stride_qt, stride_qh,
                              stride_wt, IH, BLOCK_T, BLOCK_N, PREC)
        else:
            res = tl.full([BLOCK_T, BLOCK_N], float("-inf"), tl.float32)
        tl.store(o_ptr + offs_t[:, None] * stride_ot + offs_n[None, :], res, mask=tmask[:, None] & nmask[None, :])


    @triton.jit
    def _indexer_parts_kernel(q_ptr, seg_ptr, prog_ptr, cs_ptr, w_ptr, cpos_ptr, o_ptr, T, ratio, scale,
                              stride_qt, stride_qh, stride_wt, stride_ot,
                              IH: tl.constexpr, ID: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        """`_indexer_scores_kernel` over every segment of a request in one launch: program (pid_n, pid_t) takes
        its segment and first entry from the program table, the segment's keys (canonical frame), count, Delta
        and first column from the segment table; the key tile's rope rows are turned by +Delta (cos/sin row j of
        cs_ptr) as they are loaded (the pair partner read again), so the query, roped once at t, scores them as
        the query turned to t - Delta would: q(t - D) . k = q(t) . k(+D). Rows see the entries complete before
        t - Delta; scores go to the segment's columns first..first+N of the [T, total] block."""
        pid_n = tl.program_id(0)
        pid_t = tl.program_id(1)
        j = tl.load(prog_ptr + 2 * pid_n)
        n0 = tl.load(prog_ptr + 2 * pid_n + 1).to(tl.int32)
        row = seg_ptr + 4 * j
        k_ptr = table_ptr(tl.load(row), q_ptr.dtype.element_ty)
        N = tl.load(row + 1).to(tl.int32)
        delta = tl.load(row + 2).to(tl.int32)
        first = tl.load(row + 3)
        offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        tmask = offs_t < T
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_d = tl.arange(0, ID)
        cp = tl.load(cpos_ptr + offs_t, mask=tmask, other=-1).to(tl.int32) - delta
        ready = tl.maximum(cp + 1, 0) // ratio                  # the segment's entries complete before t - Delta
        if n0 < tl.max(ready, 0):
            kp = k_ptr + offs_n[None, :].to(tl.int64) * ID
            kt = tl.load(kp + offs_d[:, None], mask=nmask[None, :], other=0.0).to(tl.float32)    # [ID, BLOCK_N]
            is_rope = offs_d >= ID - 2 * HALF
            partner = tl.load(kp + (offs_d ^ 1)[:, None], mask=nmask[None, :] & is_rope[:, None],
                              other=0.0).to(tl.float32)
            i = tl.where(is_rope, (offs_d - (ID - 2 * HALF)) // 2, 0)
            c = tl.load(cs_ptr + j * 2 * HALF + i, mask=is_rope, other=1.0)
            s = tl.load(cs_ptr + j * 2 * HALF + HALF + i, mask=is_rope, other=0.0)
            s = tl.where(offs_d % 2 == 0, -s, s)                # even: x c - x' s; odd: x c + x' s
            kt = (kt * c[:, None] + partner * s[:, None]).to(q_ptr.dtype.element_ty)
            res = _score_tile(q_ptr, w_ptr, kt, offs_t, tmask, offs_d, offs_n, ready, scale, stride_qt, stride_qh,
                              stride_wt, IH, BLOCK_T, BLOCK_N, PREC)
        else:
            res = tl.full([BLOCK_T, BLOCK_N], float("-inf"), tl.float32)
        tl.store(o_ptr + offs_t[:, None] * stride_ot + (first + offs_n)[None, :], res,
                 mask=tmask[:, None] & nmask[None, :])


def default_config(IH: int, ID: int) -> dict:
    return dict(BLOCK_T=64, BLOCK_N=128, num_warps=4, num_stages=3)


def _launch_inputs(q: torch.Tensor, weights: torch.Tensor, cpos: torch.Tensor):
    """The scoring kernels' query (unit channel stride), head weights (float32, unit head stride) and positions
    (contiguous, on q's device)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    weights = weights.float()
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    return q, weights, cpos.to(device=q.device).contiguous()


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, cpos: torch.Tensor, ratio: int = 4,
                   out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """q [T,IH,ID] roped, keys [N,ID], weights [T,IH] float32 (already scaled), cpos [T] -> scores [T,N] float32
    (-inf past the causal limit). `out` may be a [T, N] view with unit column stride (a column slice of a wider
    buffer, e.g. one segment's columns of the union)."""
    check_runnable(q)
    T, IH, ID = q.shape
    N = keys.shape[0]
    if ID & (ID - 1) or ID < 16:
        raise ValueError(f"index head dim {ID} must be a power of two >= 16")
    q, weights, cpos = _launch_inputs(q, weights, cpos)
    keys = keys.to(q.dtype).contiguous()
    if out is None:
        out = torch.empty((T, N), dtype=torch.float32, device=q.device)
    elif out.shape != (T, N) or out.dtype != torch.float32 or (N > 1 and out.stride(1) != 1):
        raise ValueError("out must be a float32 [T, N] view with unit column stride")
    if T == 0 or N == 0:
        return out
    cfg = dict(default_config(IH, ID), **(config or {}))
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(T, cfg["BLOCK_T"]))
    _indexer_scores_kernel[grid](q, keys, weights, cpos, out, T, N, int(ratio), ID ** -0.5,
                                 q.stride(0), q.stride(1), weights.stride(0), out.stride(0),
                                 IH=IH, ID=ID, BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"],
                                 PREC=dot_precision(q.dtype),
                                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def indexer_topk(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, cpos: torch.Tensor, k: int,
                 ratio: int = 4, chunk_elems: int = 1 << 29, sorted: bool = True, config: dict | None = None):
    """-> (idx [T, k'] int64, -1 where fewer than k' entries are visible; values [T, k'] float32), k' = min(k, N).
    Scores are computed and reduced `chunk_elems // N` rows at a time (2 GiB of float32 scores by default)."""
    check_runnable(q)
    T, N = q.shape[0], keys.shape[0]
    kk = min(int(k), N)
    idx = torch.full((T, kk), -1, dtype=torch.int64, device=q.device)
    vals = torch.full((T, kk), float("-inf"), dtype=torch.float32, device=q.device)
    if kk == 0 or T == 0:
        return idx, vals
    rows = max(1, min(T, chunk_elems // N))
    buf = torch.empty((rows, N), dtype=torch.float32, device=q.device)
    for a in range(0, T, rows):
        b = min(a + rows, T)
        s = indexer_scores(q[a:b], keys, weights[a:b], cpos[a:b], ratio, out=buf[: b - a], config=config)
        top = torch.topk(s, kk, dim=-1, sorted=sorted)
        vals[a:b] = top.values
        idx[a:b] = torch.where(torch.isinf(top.values), torch.full_like(top.indices, -1), top.indices)
    return idx, vals


def indexer_scores_parts(q: torch.Tensor, keys: list, deltas: list[int], cos_sin: torch.Tensor,
                         weights: torch.Tensor, cpos: torch.Tensor, out: torch.Tensor, ratio: int = 4,
                         programs: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """`indexer_scores` of every segment in one launch, the segments' keys read where they lie: q [T,IH,ID] roped
    at the request positions cpos [T]; keys[j] [N_j, ID] segment j's keys in its canonical frame (0..), placed
    at deltas[j]; cos_sin [P, 2, rd/2] float32 the rotary's cos/sin at each Delta (`cos_sin(deltas)`); out
    [T, sum N_j] float32 with unit column stride: segment j's scores in its columns (in order), -inf past the
    entries complete before cpos - Delta_j. `programs` (int64 [programs, 2] on q's device: segment, first entry;
    `parts_programs` with this config's BLOCK_N) may be made once for calls over keys of the same counts."""
    check_runnable(q)
    T, IH, ID = q.shape
    half = cos_sin.shape[-1]
    if ID & (ID - 1) or ID < 16 or half & (half - 1) or 2 * half > ID:
        raise ValueError(f"index head dim {ID} must be a power of two >= 16 and hold the rope pairs ({half})")
    counts = [k.shape[0] for k in keys]
    if cos_sin.shape != (len(keys), 2, half) or len(deltas) != len(keys):
        raise ValueError(f"cos_sin {tuple(cos_sin.shape)} and deltas must have one row per segment ({len(keys)})")
    if out.shape != (T, sum(counts)) or out.dtype != torch.float32 or (out.shape[1] > 1 and out.stride(1) != 1):
        raise ValueError("out must be a float32 [T, sum of the segments' keys] view with unit column stride")
    q, weights, cpos = _launch_inputs(q, weights, cpos)
    cfg = dict(default_config(IH, ID), **(config or {}))
    if T == 0 or not any(counts):
        return out
    keep, rows, first = [], [], 0
    for k, d, n in zip(keys, deltas, counts):
        k = aligned(k.to(q.dtype))
        keep.append(k)
        rows.append([k.data_ptr() if n else 0, n, int(d), first])
        first += n
    table = to_device_nowait(torch.tensor(rows, dtype=torch.int64), q.device)
    if programs is None:
        programs = parts_programs(counts, q.device, cfg["BLOCK_N"])
    grid = (programs.shape[0], triton.cdiv(T, cfg["BLOCK_T"]))
    _indexer_parts_kernel[grid](q, table, programs, cos_sin.float().contiguous(), weights, cpos, out, T,
                                int(ratio), ID ** -0.5, q.stride(0), q.stride(1), weights.stride(0), out.stride(0),
                                IH=IH, ID=ID, HALF=half, BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"],
                                PREC=dot_precision(q.dtype), num_warps=cfg["num_warps"],
                                num_stages=cfg["num_stages"])
    return out


def parts_programs(counts: list[int], device, block_n: int | None = None) -> torch.Tensor:
    """int64 [programs, 2] on `device`: (segment, first entry) of every block of `block_n` entries (the default
    config's BLOCK_N) of every segment: `indexer_scores_parts`' grid."""
    block_n = block_n or default_config(0, 0)["BLOCK_N"]
    progs = [(j, n0) for j, n in enumerate(counts) for n0 in range(0, n, block_n)]
    return to_device_nowait(torch.tensor(progs, dtype=torch.int64).reshape(-1, 2), device)
