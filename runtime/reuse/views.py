"""Multi-document row views: where every relocated document's field of one layer lies in ONE buffer (a staged
layer, `owned_copies`), one gather or one overlay serves every document through one [rows, width] view of it;
otherwise the rows are gathered document by document straight into place. And what a request keeps of such a
buffer: copies, not views (`keep_apart`)."""
from __future__ import annotations

from dataclasses import fields as dataclass_fields

import torch

from runtime.kernels._host import to_device_nowait
from runtime.model.deepseek_v4 import CompressorState
from .artifact import Owner
from .keys import SegmentKeys, memo


def rows_view(ts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """Where every tensor of `ts` ([n_j, w], contiguous, one dtype) lies in ONE storage on a whole row of width w
    counted from its start (LayerPrefetcher's buffer for a layer of pinned documents, `owned_copies`): a [R, w]
    view of that storage and each tensor's first row in it, so one index_copy_ / index_select serves every
    document. None otherwise (the caller goes document by document)."""
    if not ts or ts[0].dim() != 2:
        return None
    t0 = ts[0]
    st, w, es = t0.untyped_storage(), t0.shape[1], t0.element_size()
    firsts = []
    for t in ts:
        if (t.dim() != 2 or t.shape[1] != w or t.dtype != t0.dtype or not t.is_contiguous() or w == 0
                or t.untyped_storage().data_ptr() != st.data_ptr() or t.storage_offset() % w):
            return None
        firsts.append(t.storage_offset() // w)
    rows = st.nbytes() // (w * es)
    return torch.empty(0, dtype=t0.dtype, device=t0.device).set_(st, 0, (rows, w), (w, 1)), firsts


def view_rows(sp, what, firsts: list[int], parts) -> torch.Tensor:
    """The rows in a `rows_view` of `parts` [(ids of a document's rows, ...)] one after the other, given each
    document's first row: built once per request and layout (every layer of a kind has the same)."""
    def rows():
        ids = [p[0] for p in parts]
        shift = torch.tensor(firsts).repeat_interleave(torch.tensor([t.numel() for t in ids]))  # on the host
        return torch.cat(ids).add_(to_device_nowait(shift, ids[0].device))     # a fixed number of launches
    return memo(sp.view_rows, (what, tuple(firsts)), rows)


def in_larger(t) -> bool:
    """Whether `t` is a view of a buffer holding more than it (a packed staged layer's field)."""
    return t is not None and t.untyped_storage().nbytes() > t.numel() * t.element_size()


def keep_apart(segs: list[SegmentKeys], states: list[CompressorState], docs, i: int) -> None:
    """The request keeps every reusable layer's segment keys and carried compressor state to its end (later calls,
    decode). Where they are views of the request's own staged copy of a layer (`Owner.REQUEST`: LayerPrefetcher packs a
    layer's documents into ONE device buffer, W_a,L O_L and picks included), keeping a view would keep the whole
    buffer: they are copied out, one launch per field for all documents, and the buffer is freed with its layer."""
    for name in ("latent", "entries", "index_keys"):
        own = [s for j, s in enumerate(segs)
               if docs[j].layers[i].owner is Owner.REQUEST and in_larger(getattr(s, name))]
        ts = [getattr(s, name) for s in own]
        if not ts:
            continue
        if len({(t.dtype, t.shape[1:]) for t in ts}) == 1:
            parts = torch.cat(ts).split([t.shape[0] for t in ts])
        else:
            parts = [t.clone() for t in ts]
        for s, t in zip(own, parts):
            setattr(s, name, t)
    for st in states:
        for f in dataclass_fields(st):
            if in_larger(getattr(st, f.name)):
                setattr(st, f.name, getattr(st, f.name).clone())


def rows_out(out, n: int, width: int, dtype: torch.dtype, device, who: str) -> torch.Tensor:
    """The [n, width] buffer rows are gathered into: `out` when given (it must be contiguous and of that shape and
    dtype), else a new one."""
    if out is None:
        return torch.empty((n, width), dtype=dtype, device=device)
    if out.shape != (n, width) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"{who}: out must be contiguous [{n}, {width}] {dtype}, got {tuple(out.shape)} "
                         f"{out.dtype}")
    return out


def gather_rows(parts, n: int, width: int, dtype: torch.dtype, device, out=None) -> torch.Tensor:
    """[n, width]: for each (src [m, width], ids, off) of `parts`, rows off.. of the result (`out`, given) =
    src[ids], gathered straight into place (no temporary per part). The parts must cover rows 0..n-1."""
    spans = sorted((off, off + ids.numel()) for _, ids, off in parts)
    ends = [0] + [b for _, b in spans]
    if [a for a, _ in spans] != ends[:-1] or ends[-1] != n:     # no row left unwritten, none written twice
        raise ValueError(f"the parts' row ranges {spans} must tile rows 0..{n - 1} exactly")
    out = rows_out(out, n, width, dtype, device, "gather_rows")
    for src, ids, off in parts:
        dst = out[off:off + ids.numel()]
        if src.dtype == dtype and src.device == dst.device:
            torch.index_select(src, 0, ids, out=dst)
        else:
            dst.copy_(src.index_select(0, ids.to(src.device)))
    return out

