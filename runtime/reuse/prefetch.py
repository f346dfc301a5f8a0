"""Staging artifacts to the device one layer group ahead of the forward.

`LayerPrefetcher` (benchmarks): hot artifacts already in pinned host memory, staged one layer ahead on a
dedicated CUDA stream. The consumer asks for layer i; the copy of layer i (issued while layer i-1 ran) is ordered
before its use by a CUDA event that the compute stream waits on (a device-side wait, never a host poll), and layer
i+1's copy is issued at once. A layer's buffer is allocated from the compute stream's pool (one pool for the
forward and its staging); the side stream waits for that allocation before writing it.

`GroupStager` (the worker): one request's documents arriving layer group by layer group (from the store or the
host tier, `StagedSource`). A pool of staging threads takes each group as soon as its bytes are there, verifies
every shard against the already validated certificate (`read_layers`) and pins it (`pin_layers`; both once per
fetch, shared with the worker's tier: `StagedSource.read`), and on CUDA issues its host->device copies on a side
stream, then records the group's CUDA event; on CPU the same pipeline runs with threads and no copies.
The forward asks for layer i; the stager waits (host side) only until group(i) was staged, lets the TP ranks agree
on that group's verdict (one small collective on the control group, the same point on every rank), then makes the
compute stream wait on the group's event. A group any rank rejected raises `StagingRejected` on every rank at the
same layer: the caller restarts the request in the recompute arm (docs/services.md)."""
from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields

import torch

from runtime.model.parallel import Parallel
from .artifact import DocumentArtifact, LayerArtifact, is_private
from .certificate import FallbackReason, Verdict, agree
from .store import ArtifactHead, read_layers


_FIELDS = tuple(f.name for f in fields(LayerArtifact))


def _map(la: LayerArtifact, fn) -> LayerArtifact:
    out = {}
    for name in _FIELDS:
        v = getattr(la, name)
        if isinstance(v, tuple):
            v = tuple(fn(t) for t in v)
        elif isinstance(v, torch.Tensor):
            v = fn(v)
        out[name] = v
    return LayerArtifact(**out)


def _tensors(la: LayerArtifact) -> list[torch.Tensor]:
    """`la`'s tensors in `_map`'s order."""
    out = []
    for name in _FIELDS:
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
    ts = _tensors(la)
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
    rows of one field are rows of ONE [rows, width] view of the buffer (the consumer's overlays and gathers then
    take one launch for all documents, `consumer._rows_view`)."""
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


def _pack_into(la: LayerArtifact, flat: torch.Tensor, offs: list[int], non_blocking: bool = False) -> LayerArtifact:
    """`la` packed into `flat` at `offs` (its `_layout` offsets)."""
    ts = _tensors(la)
    views = iter([_view_at(flat, o, t).copy_(t, non_blocking) for t, o in zip(ts, offs)])
    return _map(la, lambda t: next(views))


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
    """The host bytes (uint8) all of `la`'s tensors are views of, laid out as `pin` packs them (`_layout`) from a start on the
    layer's alignment (a buffer of its own, or its place in a `pin` slab); None where they are not (separate
    tensors, another layout, a strided tensor, or on a device). `ts`: `_tensors(la)`, where the caller has them."""
    ts = _tensors(la) if ts is None else ts
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
            ts: list[torch.Tensor] | None = None) -> LayerArtifact:
    """`la`'s views (a `packed_storage` layer's: contiguous, laid out by `_layout`) rebuilt on `flat`, a copy of its
    bytes (e.g. on the device); `offs`, `ts`: that layout's offsets and `_tensors(la)`, where the caller has them."""
    ts = _tensors(la) if ts is None else ts
    typed: dict[torch.dtype, torch.Tensor] = {}     # `flat` seen as each dtype once; then one as_strided a tensor

    def view(t: torch.Tensor, o: int) -> torch.Tensor:
        base = typed.get(t.dtype)
        if base is None:
            base = typed[t.dtype] = flat.view(t.dtype)
        return base.as_strided(t.shape, _contiguous_strides(t.shape), base.storage_offset() + o // t.element_size())
    views = iter([view(t, o) for t, o in zip(ts, _layout(ts)[0] if offs is None else offs)])
    return _map(la, lambda t: next(views))


def pack_documents(layers: list[LayerArtifact], device, copy=None,
                   sources: list[torch.Tensor] | None = None, alloc=None,
                   plans: list | None = None) -> tuple[list[LayerArtifact], int]:
    """Several documents' layer in ONE new buffer on `device`, document after document, each at a multiple of every
    document's alignment (`_layout`): the consumer reads every document's rows of a field through one view. With
    `copy` (LayerPrefetcher: an asynchronous host->device copy into a slot of the buffer) each `packed_storage`
    layer is copied whole, once (`sources`: their storages, where the caller has them; None for a layer that is
    not packed), and any other is packed into its slot tensor by tensor (asynchronous copies too); without `copy`
    each tensor is packed into place. `alloc(n)` makes the buffer (default: torch.empty on `device`). `plans`: per
    layer (its tensors, their `_layout`), where the caller has them (`host_plan`). Returns the documents' layers and
    the bytes of the buffer."""
    if copy is not None:
        sources = [packed_storage(la) for la in layers] if sources is None else sources
        if len(sources) != len(layers):
            raise ValueError(f"{len(sources)} sources for {len(layers)} layers")
    if plans is None:
        plans = [(ts, _layout(ts)) for ts in map(_tensors, layers)]
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
            out.append(rebuild(la, slot, offs, ts))
        else:
            out.append(_pack_into(la, slot, offs, non_blocking=copy is not None))
    return out, n


def pin_layers(src: Sequence[LayerArtifact]) -> list[LayerArtifact]:
    """Copies of `src` whose tensors live in page-locked host memory; plain host memory where no GPU exists
    (page-locking needs one). Each layer's tensors are packed in one run of bytes (`_layout`), so the prefetcher
    stages a layer with one copy; the layers lie in power-of-two slabs (`slab_plan`), so the pinned allocator's
    rounding wastes little (one buffer per layer could double the host memory)."""
    pinned = torch.cuda.is_available()
    layouts = [_layout(_tensors(la)) for la in src]
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


class _Private(Sequence):
    """Layers that are this request's own (the consumer may write them in place)."""

    def __init__(self, layers):
        self.layers = layers

    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def private(self, i: int) -> bool:
        return True


class _OwnedLayers(_Private):
    def __init__(self, layers):
        super().__init__([_map(la, torch.clone) for la in layers])


def owned_copy(doc: DocumentArtifact) -> DocumentArtifact:
    """A copy of `doc` made for one request, on the same device: its layers say they are `private`, so the consumer
    overlays active rows in place on them, as on the copies LayerPrefetcher and GroupStager stage on CUDA."""
    return DocumentArtifact(doc.tokens, doc.n_content, _OwnedLayers(doc.layers), doc.tp_rank, doc.tp_size,
                            dict(doc.meta))


def owned_copies(docs: list[DocumentArtifact]) -> list[DocumentArtifact]:
    """`owned_copy` of a request's documents laid out as LayerPrefetcher stages pinned documents: each layer of all
    documents in one buffer (`pack_documents`), so the consumer's one-view overlays and gathers run."""
    dev = docs[0].layers[0].latent.device
    per_layer = [pack_documents([d.layers[i] for d in docs], dev)[0] for i in range(len(docs[0].layers))]
    return [DocumentArtifact(d.tokens, d.n_content, _Private([per_layer[i][j] for i in range(len(per_layer))]),
                             d.tp_rank, d.tp_size, dict(d.meta)) for j, d in enumerate(docs)]


class LayerPrefetcher:
    def __init__(self, docs: list[DocumentArtifact], device: torch.device, depth: int = 1):
        self.docs, self.device, self.depth = docs, torch.device(device), depth
        self.n_layers = len(docs[0].layers)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        # per layer: every document's staged layer, the copy's event, and one tensor per storage they are views of
        # (what the compute stream records once it reads them)
        self.staged: dict[int, tuple[list[LayerArtifact], object, list[torch.Tensor]]] = {}
        self._ready: set[int] = set()           # layers whose copy the compute stream already waits on
        self._private: dict[int, list[bool]] = {}   # per layer and document: every tensor is this request's copy
        self.bytes_copied = 0
        self.loose = 0              # (layer, document) pairs staged tensor by tensor: not packed by `pin`

    def _issue(self, i: int) -> None:
        if i in self.staged or i >= self.n_layers:
            return
        inner = [is_private(d, i) for d in self.docs]      # layers already this request's own (GroupStager)
        if not self.cuda:
            self.staged[i] = ([d.layers[i] for d in self.docs], None, [])
            self._private[i] = inner
            return
        cur = torch.cuda.current_stream(self.device)
        held: list[torch.Tensor] = []

        def alloc(n: int) -> torch.Tensor:
            # the layer's buffer comes from the compute stream's pool, which reads it and frees it: blocks cached
            # for the side stream cannot serve the compute stream's allocations, and with them beside what a
            # recompute-sized forward leaves cached, a 128K reuse request made the allocator retry (free its cache,
            # synchronizing every stream) and map memory anew, 61 cudaMallocs a request; with one pool, none
            # (docs/BENCHMARKS.md run 15).
            # The side stream writes it only once the compute stream reached this allocation (the block may be one
            # the compute stream freed and its queued work still uses), and it is recorded on the side stream so
            # that a buffer freed before its copy ended (a layer never read) is not reused early.
            with torch.cuda.stream(cur):
                buf = torch.empty(n, dtype=torch.uint8, device=self.device)
                ev = torch.cuda.Event()
                ev.record(cur)
            self.stream.wait_event(ev)
            buf.record_stream(self.stream)
            held.append(buf)                   # every staged tensor of the layer is a view of this one buffer
            return buf

        with torch.cuda.stream(self.stream):
            copied = []

            def copy(t):
                self.bytes_copied += t.numel() * t.element_size()
                out = t.to(self.device, non_blocking=True)
                copied[-1] &= out.data_ptr() != t.data_ptr()      # already on the device: no copy was made
                return out
            host = [d.layers[i] for d in self.docs]
            hp = [host_plan(la) for la in host]
            if all(t.device.type == "cpu" for ts, _, _ in hp for t in ts):
                # host documents: one buffer for the whole layer; a pinned, packed document's layer (`pin`) is
                # copied whole (one copy), any other tensor by tensor into its slot (counted in `loose`)
                sources = [src for _, _, src in hp]
                self.loose += sum(src is None for src in sources)
                layers, n = pack_documents(host, self.device, lambda slot, src: slot.copy_(src, non_blocking=True),
                                           sources, alloc, [(ts, lay) for ts, lay, _ in hp])
                self.bytes_copied += n
                copied = [True] * len(host)
            else:
                layers = []
                for la in host:
                    copied.append(True)
                    layers.append(_map(la, copy))
                seen = set()                   # once per storage
                for la in layers:
                    for t in _tensors(la):
                        if t.untyped_storage().data_ptr() not in seen:
                            seen.add(t.untyped_storage().data_ptr())
                            held.append(t)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.staged[i] = (layers, ev, held)
        self._private[i] = [c or p for c, p in zip(copied, inner)]

    def get(self, i: int) -> list[LayerArtifact]:
        """Every document's layer i, ready for the compute stream. The first call for a layer makes the compute
        stream wait on its copy, records its tensors on that stream and issues the next layers' copies; later
        calls for the same layer (the consumer reads one layer's fields document by document) only look it up."""
        if i in self._ready:
            return self.staged[i][0]
        self._issue(i)
        layers, ev, held = self.staged[i]
        if ev is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(ev)
            for t in held:
                t.record_stream(cur)
        self._ready.add(i)
        for j in range(i + 1, i + 1 + self.depth):
            self._issue(j)
        for old in [k for k in self.staged if k < i]:
            del self.staged[old]
            self._ready.discard(old)
            self._private.pop(old, None)
        return layers

    def private(self, i: int, j: int) -> bool:
        """Whether document j's staged layer i is this request's alone, which the consumer may overwrite in place
        (its overlays) instead of copying it first: a device copy made here, or layers that already said so (a
        GroupStager's, an `owned_copy`). False where nothing was copied from the caller's own tensors (no GPU, or
        tensors already on the device), and for a layer not staged yet (known once it was read)."""
        return self._private.get(i, [False] * len(self.docs))[j]

    def documents(self) -> list[DocumentArtifact]:
        """Views of the documents whose `layers[i]` comes through this prefetcher."""
        return [DocumentArtifact(d.tokens, d.n_content, _StagedLayers(self, j), d.tp_rank, d.tp_size, d.meta)
                for j, d in enumerate(self.docs)]


class _StagedLayers:
    def __init__(self, pf: LayerPrefetcher, j: int):
        self.pf, self.j = pf, j

    def __getitem__(self, i: int) -> LayerArtifact:
        return self.pf.get(i)[self.j]

    def __len__(self) -> int:
        return self.pf.n_layers

    def private(self, i: int) -> bool:
        return self.pf.private(i, self.j)


# ============================================================================ layer groups as they arrive

class SourceError(Exception):
    """A shard source could not deliver (store error, unreadable tier file): the rank's fallback reason."""

    def __init__(self, reason: FallbackReason, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class StagedSource:
    """One document's rank artifact as it arrives: `head` gives the certificate and manifest bytes, each of
    `groups` the shard bytes of its layers (file name -> bytes); a failed future raises SourceError."""
    head: Future
    groups: tuple[tuple[range, Future], ...]
    _read: dict = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def read(self, g: int, head: ArtifactHead) -> tuple[list[LayerArtifact] | None, Verdict]:
        """Group g's layers from its bytes, verified against `head`'s certificate, parsed (`read_layers`) and
        pinned (`pin_layers`), once per source and certificate: the request's stager copies them to the device and
        the worker's tier keeps them, so each byte is hashed, parsed and pinned once for both. Waits for the
        group's bytes; never raises on content."""
        key = (g, tuple(sorted(head.certificate.shard_digests.items())))
        with self._lock:
            once = self._read.get(key)
            if once is None:
                once = self._read[key] = [threading.Lock(), None]
        with once[0]:
            if once[1] is None:
                files, v = source_verdict(self.groups[g][1])
                arts, v = read_layers(head, self.groups[g][0], files) if v.ok else (None, v)
                once[1] = (pin_layers(arts) if v.ok else None), v
            return once[1]


def source_verdict(fut: Future) -> tuple[dict[str, bytes] | None, Verdict]:
    """Wait for one future of a source; its failure as a reject (a non-SourceError is the store's fault)."""
    try:
        return fut.result(), Verdict.accept()
    except SourceError as e:
        return None, Verdict.reject(e.reason, e.detail)
    except Exception as e:      # an unexpected source failure degrades to recompute, never to a crash
        return None, Verdict.reject(FallbackReason.STORE_UNAVAILABLE, f"{type(e).__name__}: {e}")


@dataclass(frozen=True)
class HotSource:
    """One document's rank artifact already verified and in (pinned) host memory: the worker's tier. `head` is its
    certificate and manifest (the request checks only their binding, `store.check_binding`); `doc` its layers,
    each verified against that certificate when it entered the tier, never written by a request."""
    head: ArtifactHead
    doc: DocumentArtifact


class StagingRejected(Exception):
    """A layer group that some rank could not verify, raised on every rank at the same layer. `verdict` is the
    agreed one (this rank's own reason when it rejected, rank_disagreement otherwise)."""

    def __init__(self, group: int, verdict: Verdict):
        super().__init__(f"layer group {group}: {verdict.reason.value}: {verdict.detail}")
        self.group, self.verdict = group, verdict


class Trace:
    """What happened when, as an ordered list of (event, group): `fetch_start`/`fetch_done` (a source),
    `staged` (verified, copies issued, event recorded), `ready` (the forward waited on the event), `consume`
    (the forward got the group). Only for proving the pipeline's order in tests; `wait` lets a test hold a
    source back until the forward reached some point."""

    def __init__(self):
        self._cond = threading.Condition()
        self.events: list[tuple[str, int]] = []

    def add(self, event: str, group: int) -> None:
        with self._cond:
            self.events.append((event, group))
            self._cond.notify_all()

    def index(self, event: str, group: int) -> int:
        with self._cond:
            return self.events.index((event, group))

    def wait(self, event: str, group: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: (event, group) in self.events, timeout)


@dataclass
class _Staged:
    verdict: Verdict
    layers: list[list[LayerArtifact]] | None = None      # per document, the group's layers (on the device)
    event: object = None                                 # torch.cuda.Event on CUDA


STAGE_THREADS = 4


class GroupStager:
    """`sources`: per document a StagedSource (bytes arriving group by group) or a HotSource (its layers already
    verified in host memory, taken group by group in the same order). `groups`: the layer groups (default: the
    StagedSources' grouping, which every StagedSource shares; required where every document is hot)."""

    def __init__(self, heads: Sequence[ArtifactHead], sources: Sequence[StagedSource | HotSource],
                 device: torch.device, control: Parallel, trace: Trace | None = None,
                 groups: Sequence[range] | None = None):
        assert len(heads) == len(sources) and heads, (len(heads), len(sources))
        self.heads, self.sources, self.control, self.trace = list(heads), list(sources), control, trace
        staged = [s for s in sources if isinstance(s, StagedSource)]
        assert staged or groups, "GroupStager needs the layer groups where every document is hot"
        self.groups = list(groups) if groups else [g for g, _ in staged[0].groups]
        assert all([g for g, _ in s.groups] == self.groups for s in staged), "every document uses one grouping"
        self.n_layers = self.groups[-1].stop
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._futures: list[Future] = []
        self._agreed = -1                               # groups 0.._agreed passed the cross-rank agreement
        self._waited: set[int] = set()
        # groups are staged STAGE_THREADS at a time (hashing, parsing and pinning release the GIL): one thread
        # staged 0.9-1.2 GB/s while the forward waited on it
        self._pool = ThreadPoolExecutor(min(STAGE_THREADS, len(self.groups)), thread_name_prefix="stage")
        self._count = threading.Lock()
        self.bytes_copied = 0

    def start(self) -> "GroupStager":
        """Stage every group in order, each as soon as its bytes arrived; never waits."""
        self._futures = [self._pool.submit(self._stage, g) for g in range(len(self.groups))]
        self._pool.shutdown(wait=False)
        return self

    def _note(self, event: str, group: int) -> None:
        if self.trace is not None:
            self.trace.add(event, group)

    def _stage(self, g: int) -> _Staged:
        layers = self.groups[g]
        per_doc = []
        for head, src in zip(self.heads, self.sources):
            if isinstance(src, HotSource):
                per_doc.append([src.doc.layers[i] for i in layers])
                continue
            arts, v = src.read(g, head)
            if not v.ok:
                self._note("staged", g)
                return _Staged(v)
            per_doc.append(arts)
        if not self.cuda:
            self._note("staged", g)
            return _Staged(Verdict.accept(), per_doc)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            def copy(t: torch.Tensor) -> torch.Tensor:
                with self._count:
                    self.bytes_copied += t.numel() * t.element_size()
                # pinned already (tier documents, `StagedSource.read`): pin_memory() returns them as they are
                return (t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True)
            staged = [[_map(la, copy) for la in arts] for arts in per_doc]
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._note("staged", g)
        return _Staged(Verdict.accept(), staged, ev)

    def group_of(self, layer: int) -> int:
        return next(g for g, r in enumerate(self.groups) if layer in r)

    def get(self, layer: int) -> list[LayerArtifact]:
        """Every document's layer `layer`, ready for the compute stream; raises StagingRejected."""
        g = self.group_of(layer)
        while self._agreed < g:                 # groups are agreed in order, each once, on every rank alike
            h = self._agreed + 1
            verdict = agree(self._futures[h].result().verdict, self.control)
            if not verdict.ok:
                raise StagingRejected(h, verdict)
            self._agreed = h
        st = self._futures[g].result()
        if g not in self._waited:
            self._waited.add(g)
            if st.event is not None:
                cur = torch.cuda.current_stream(self.device)
                cur.wait_event(st.event)        # a device-side wait: the host does not block on the copy
                for arts in st.layers:
                    for la in arts:
                        _map(la, lambda t: (t.record_stream(cur), t)[1])
            self._note("ready", g)
            self._note("consume", g)
        i = layer - self.groups[g].start
        return [arts[i] for arts in st.layers]

    def documents(self) -> list[DocumentArtifact]:
        """The documents whose `layers[i]` comes through `get(i)`."""
        return [h.document(_GroupLayers(self, j)) for j, h in enumerate(self.heads)]


class _GroupLayers(Sequence):
    def __init__(self, stager: GroupStager, j: int):
        self.stager, self.j = stager, j

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.stager.get(i)[self.j]

    def __len__(self) -> int:
        return self.stager.n_layers

    def private(self, i: int) -> bool:
        """On CUDA every staged tensor is this request's own device copy (pinned, then copied): see
        LayerPrefetcher.private."""
        return self.stager.cuda
