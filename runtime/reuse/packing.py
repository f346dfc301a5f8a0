"""A layer's tensors packed in one run of bytes, and documents packed for staging: the layout (`_layout`), the
hot tier's pinned power-of-two slabs (`pin`, `slab_plan`), several documents' layer in one device buffer
(`pack_documents`: the engine then reads every document's rows of a field through one view), and copies made for
one request (`owned_copy`, `owned_copies`). Whoever makes a LayerArtifact here says who owns it (`Owner`)."""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import fields

import torch

from .artifact import DocumentArtifact, LayerArtifact, Owner


@functools.cache
def _fields(kind: type) -> tuple[str, ...]:
    """A layer type's tensor fields (LayerArtifact, or the Llama family's KVLayerArtifact), in declaration order."""
    return tuple(f.name for f in fields(kind) if f.name != "owner")


def map_layer(la: LayerArtifact, fn, owner: Owner = Owner.CALLER) -> LayerArtifact:
    """A new layer of `la`'s type holding `fn` of each of `la`'s tensors; `owner`: who owns the new one (its maker
    says: `Owner.REQUEST` only for a copy made for one request)."""
    out = {"owner": owner}
    for name in _fields(type(la)):
        v = getattr(la, name)
        if isinstance(v, tuple):
            v = tuple(fn(t) for t in v)
        elif isinstance(v, torch.Tensor):
            v = fn(v)
        out[name] = v
    return type(la)(**out)


def layer_tensors(la: LayerArtifact) -> list[torch.Tensor]:
    """`la`'s tensors in `map_layer`'s order."""
    out = []
    for name in _fields(type(la)):
        v = getattr(la, name)
        if isinstance(v, tuple):
            out.extend(v)
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out


def host_plan(la: LayerArtifact) -> tuple[list[torch.Tensor], tuple[list[int], int, int], torch.Tensor | None]:
    """(`la`'s tensors, their `_layout`, their `packed_storage`), kept on the layer while its fields hold the same
    tensor objects: a hot artifact's layer is staged once per request, and recomputing its layout each time (ten
    tensors, eight documents, every layer) was host time the GPU waited on where a reusable layer is short (16K)."""
    ts = layer_tensors(la)
    memo = la.__dict__.get("_rk_host_plan")
    if memo is not None and len(memo[0]) == len(ts) and all(a is b for a, b in zip(memo[0], ts)):
        return memo
    memo = (ts, _layout(ts), packed_storage(la, ts))
    la.__dict__["_rk_host_plan"] = memo
    return memo


PACK_ALIGN = 256          # bytes: every tensor of a packed layer starts on this boundary (as the allocator's blocks)


def _align(t: torch.Tensor) -> int:
    """Where `t` may start in a packed buffer: a multiple of PACK_ALIGN and of its row's bytes, so that in a buffer
    holding several documents' layers (each document at a multiple of all its tensors' alignments) every document's
    rows of one field are rows of ONE [rows, width] view of the buffer (the engine's overlays and gathers then
    take one launch for all documents, `views.rows_view`)."""
    row = math.prod(t.shape[1:]) * t.element_size() if t.dim() >= 1 else t.element_size()
    return math.lcm(PACK_ALIGN, row) if row else PACK_ALIGN


def _layout(ts: list[torch.Tensor]) -> tuple[list[int], int, int]:
    """Packed byte offsets of `ts`, the buffer's size and the alignment its start needs."""
    offs, n, whole = [], 0, PACK_ALIGN
    for t in ts:
        a = _align(t)
        whole = math.lcm(whole, a)
        n = -(-n // a) * a
        offs.append(n)
        n += t.numel() * t.element_size()
    return offs, -(-n // whole) * whole, whole


def _view_at(flat: torch.Tensor, o: int, t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor shaped as `t` on bytes o.. of `flat` (uint8)."""
    return flat[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)


def _pack_into(la: LayerArtifact, flat: torch.Tensor, offs: list[int], non_blocking: bool = False,
               owner: Owner = Owner.CALLER) -> LayerArtifact:
    """`la` packed into `flat` at `offs` (its `_layout` offsets), owned by `owner`."""
    ts = layer_tensors(la)
    views = iter([_view_at(flat, o, t).copy_(t, non_blocking) for t, o in zip(ts, offs)])
    return map_layer(la, lambda t: next(views), owner)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def slab_plan(sizes: list[int], aligns: list[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    """Host buffers ("slabs") for a document's packed layers: [(slab bytes, [(layer, byte offset)])], every slab a
    power of two. torch's pinned allocator rounds each allocation up to a power of two, so one buffer per layer
    wastes up to half of it (a 257 MiB layer takes 512 MiB); slabs of exactly a power of two waste only the tail
    that no further layer fills. At each slab: either one slab for all the layers left, or the next power of two
    down (never below the largest layer's) filled in order and the rest planned alike; the smaller total wins."""
    n = len(sizes)

    def fill(i, cap):
        placed, o = [], 0
        while i < n:
            start = -(-o // aligns[i]) * aligns[i]
            if start + sizes[i] > cap:
                break
            placed.append((i, start))
            o = start + sizes[i]
            i += 1
        return placed, i

    def plan_from(i):
        if i == n:
            return []
        rest = sum(-(-sizes[j] // aligns[j]) * aligns[j] for j in range(i, n))
        up = _pow2_ceil(max(rest, PACK_ALIGN))
        best = [(up, fill(i, up)[0])]                       # rest is the padded bytes: one slab of `up` holds all
        if up // 2 >= _pow2_ceil(max(max(sizes[i:]), 1)):
            placed, j = fill(i, up // 2)
            other = [(up // 2, placed)] + plan_from(j)
            if sum(c for c, _ in other) < up:
                best = other
        return best
    return plan_from(0)


def packed_storage(la: LayerArtifact, ts: list[torch.Tensor] | None = None) -> torch.Tensor | None:
    """The host bytes (uint8) all of `la`'s tensors are views of, laid out as `pin` packs them (`_layout`) from a
    start on the layer's alignment (a buffer of its own, or its place in a `pin` slab); None where they are not
    (separate tensors, another layout, a strided tensor, or on a device). `ts`: `layer_tensors(la)`, where the
    caller has them."""
    ts = layer_tensors(la) if ts is None else ts
    if not ts or any(t.device.type != "cpu" or not t.is_contiguous() for t in ts):
        return None
    st = ts[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != st.data_ptr() for t in ts):
        return None
    offs, size, whole = _layout(ts)
    base = ts[0].storage_offset() * ts[0].element_size()
    if (base % whole or base + size > st.nbytes()
            or [t.storage_offset() * t.element_size() - base for t in ts] != offs):
        return None
    return torch.empty(0, dtype=torch.uint8).set_(st, base, (size,), (1,))


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape) -> tuple[int, ...]:
    """The strides torch gives a new contiguous tensor of `shape` (a size-0 dim counts as 1, as torch counts it)."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def rebuild(la: LayerArtifact, flat: torch.Tensor, offs: list[int] | None = None,
            ts: list[torch.Tensor] | None = None, owner: Owner = Owner.CALLER) -> LayerArtifact:
    """`la`'s views (a `packed_storage` layer's: contiguous, laid out by `_layout`) rebuilt on `flat`, a copy of its
    bytes (e.g. on the device), owned by `owner`; `offs`, `ts`: that layout's offsets and `layer_tensors(la)`, where
    the caller has them."""
    ts = layer_tensors(la) if ts is None else ts
    typed: dict[torch.dtype, torch.Tensor] = {}     # `flat` seen as each dtype once; then one as_strided a tensor

    def view(t: torch.Tensor, o: int) -> torch.Tensor:
        base = typed.get(t.dtype)
        if base is None:
            base = typed[t.dtype] = flat.view(t.dtype)
        return base.as_strided(t.shape, _contiguous_strides(t.shape), base.storage_offset() + o // t.element_size())
    views = iter([view(t, o) for t, o in zip(ts, _layout(ts)[0] if offs is None else offs)])
    return map_layer(la, lambda t: next(views), owner)


def pack_documents(layers: list[LayerArtifact], device, copy=None,
                   sources: list[torch.Tensor] | None = None, alloc=None,
                   plans: list | None = None, owner: Owner = Owner.CALLER) -> tuple[list[LayerArtifact], int]:
    """Several documents' layer in ONE new buffer on `device`, document after document, each at a multiple of every
    document's alignment (`_layout`): the engine reads every document's rows of a field through one view. With
    `copy` (LayerPrefetcher: an asynchronous host->device copy into a slot of the buffer) each `packed_storage`
    layer is copied whole, once (`sources`: their storages, where the caller has them; None for a layer that is
    not packed), and any other is packed into its slot tensor by tensor (asynchronous copies too); without `copy`
    each tensor is packed into place. `alloc(n)` makes the buffer (default: torch.empty on `device`). `plans`: per
    layer (its tensors, their `_layout`), where the caller has them (`host_plan`). `owner`: who owns the new layers
    (`Owner.REQUEST` where the buffer is made for one request). Returns the documents' layers and the bytes of the
    buffer."""
    if copy is not None:
        sources = [packed_storage(la) for la in layers] if sources is None else sources
        if len(sources) != len(layers):
            raise ValueError(f"{len(sources)} sources for {len(layers)} layers")
    if plans is None:
        plans = [(ts, _layout(ts)) for ts in map(layer_tensors, layers)]
    if len(plans) != len(layers):
        raise ValueError(f"{len(plans)} plans for {len(layers)} layers")
    whole = math.lcm(*[a for _, (_, _, a) in plans])
    starts, n = [], 0
    for _, (_, size, _) in plans:
        starts.append(n)
        n += -(-size // whole) * whole
    buf = alloc(n) if alloc is not None else torch.empty(n, dtype=torch.uint8, device=device)
    out = []
    for j, (la, (ts, (offs, size, _)), o) in enumerate(zip(layers, plans, starts)):
        slot = buf[o:o + size]
        if copy is not None and sources[j] is not None:
            copy(slot, sources[j])
            out.append(rebuild(la, slot, offs, ts, owner))
        else:
            out.append(_pack_into(la, slot, offs, non_blocking=copy is not None, owner=owner))
    return out, n


def pin_layers(src: Sequence[LayerArtifact]) -> list[LayerArtifact]:
    """Copies of `src` whose tensors live in page-locked host memory; plain host memory where no GPU exists
    (page-locking needs one). Each layer's tensors are packed in one run of bytes (`_layout`), so the prefetcher
    stages a layer with one copy; the layers lie in power-of-two slabs (`slab_plan`), so the pinned allocator's
    rounding wastes little (one buffer per layer could double the host memory)."""
    pinned = torch.cuda.is_available()
    layouts = [_layout(layer_tensors(la)) for la in src]
    layers: list[LayerArtifact | None] = [None] * len(src)
    for cap, placed in slab_plan([size for _, size, _ in layouts], [whole for _, _, whole in layouts]):
        slab = torch.empty(cap, dtype=torch.uint8, pin_memory=pinned)
        for li, o in placed:
            layers[li] = _pack_into(src[li], slab[o:o + layouts[li][1]], layouts[li][0])
    return layers


def pin(doc: DocumentArtifact) -> DocumentArtifact:
    """A copy of `doc` in page-locked host memory (the hot tier): `pin_layers` of its layers."""
    return DocumentArtifact(doc.tokens, doc.n_content, pin_layers(doc.layers), doc.tp_rank, doc.tp_size,
                            dict(doc.meta))


def owned_copy(doc: DocumentArtifact) -> DocumentArtifact:
    """A copy of `doc` made for one request, on the same device: its layers are `Owner.REQUEST`, so the engine
    overlays active rows in place on them, as on the copies LayerPrefetcher and GroupStager stage on CUDA."""
    layers = [map_layer(la, torch.clone, Owner.REQUEST) for la in doc.layers]
    return DocumentArtifact(doc.tokens, doc.n_content, layers, doc.tp_rank, doc.tp_size, dict(doc.meta))


def owned_copies(docs: list[DocumentArtifact]) -> list[DocumentArtifact]:
    """`owned_copy` of a request's documents laid out as LayerPrefetcher stages pinned documents: each layer of all
    documents in one buffer (`pack_documents`), so the engine's one-view overlays and gathers run."""
    dev = docs[0].layers[0].latent.device
    per_layer = [pack_documents([d.layers[i] for d in docs], dev, owner=Owner.REQUEST)[0]
                 for i in range(len(docs[0].layers))]
    return [DocumentArtifact(d.tokens, d.n_content, [per_layer[i][j] for i in range(len(per_layer))],
                             d.tp_rank, d.tp_size, dict(d.meta)) for j, d in enumerate(docs)]
