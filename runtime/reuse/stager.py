"""`GroupStager` (the worker): one request's documents arriving layer group by layer group (from the store or the
host tier, `StagedSource`; or already verified in the tier, `HotSource`). A pool of staging threads takes each group
as soon as its bytes are there, verifies every shard against the already validated certificate (`read_layers`: the
tensors are views of the fetched bytes) and pins it (`pin_layers`: the one copy; both once per fetch, shared with the
worker's tier: `StagedSource.read`). The forward asks for layer i; the stager waits (host side) only until group(i)
was staged, and lets the TP ranks agree on that group's verdict (one small collective on the control group, the
same point on every rank). On CUDA the agreed host layers reach the device as a tier hit's do (`LayerPrefetcher`:
one buffer per layer for every document, one layer ahead on a copy stream; the copy of layer i+1 is issued when
the forward takes layer i, so group g+1 is agreed there). A group any rank rejected raises `StagingRejected` on
every rank at the same layer: the caller restarts the request in the recompute arm (docs/services.md).

Ownership: a device copy made here is this request's own (`Owner.REQUEST`, overlaid in place); on CPU the layers
are the tier's (`Owner.CALLER`, as `pin_layers` made them), which the engine copies before writing."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from runtime.model.parallel import Parallel
from .artifact import DocumentArtifact, LayerArtifact
from .certificate import FallbackReason, Verdict, agree
from .direct import DirectGroup
from .packing import pin_layers
from .prefetcher import LayerPrefetcher
from .store import ArtifactHead, read_layers


class SourceError(Exception):
    """A shard source could not deliver (store error, unreadable tier file): the rank's fallback reason."""

    def __init__(self, reason: FallbackReason, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class StagedSource:
    """One document's rank artifact as it arrives: `head` gives the certificate and manifest bytes, each of
    `groups` the shard bytes of its layers (file name -> bytes) or those layers already read into their slabs (a
    `DirectGroup`, from the store's local socket); a failed future raises SourceError."""
    head: Future
    groups: tuple[tuple[range, Future], ...]
    _read: dict = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def read(self, g: int, head: ArtifactHead) -> tuple[list[LayerArtifact] | None, Verdict]:
        """Group g's layers from its bytes, verified against `head`'s certificate, parsed (`read_layers`) and
        pinned (`pin_layers`), once per source and certificate: the request's stager copies them to the device and
        the worker's tier keeps them, so each byte is hashed, parsed and pinned once for both. A `DirectGroup`
        arrived verified against the store's digests and in its slabs: only its digests are compared with the
        certificate's. Waits for the group's bytes; never raises on content."""
        key = (g, tuple(sorted(head.certificate.shard_digests.items())))
        with self._lock:
            once = self._read.get(key)
            if once is None:
                once = self._read[key] = [threading.Lock(), None]
        with once[0]:
            if once[1] is None:
                files, v = source_verdict(self.groups[g][1])
                if v.ok and isinstance(files, DirectGroup):
                    once[1] = files.result(head)
                else:
                    arts, v = read_layers(head, self.groups[g][0], files) if v.ok else (None, v)
                    once[1] = (pin_layers(arts) if v.ok else None), v
            return once[1]

    def read_all(self, head: ArtifactHead) -> tuple[list[LayerArtifact] | None, Verdict]:
        """Every group's layers in order (`read`, each group once), or the first group's reject."""
        layers: list[LayerArtifact] = []
        for g in range(len(self.groups)):
            arts, v = self.read(g, head)
            if not v.ok:
                return None, v
            layers.extend(arts)
        return layers, Verdict.accept()


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

    def __init__(self, group: int, verdict: Verdict, document: int | None = None):
        super().__init__(f"layer group {group}: {verdict.reason.value}: {verdict.detail}")
        self.group, self.verdict = group, verdict
        self.document = document        # the index of the document whose shards THIS rank rejected (None: it followed)


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
    layers: list[list[LayerArtifact]] | None = None      # per document, the group's layers (verified, in host memory)
    document: int | None = None                          # the first document whose part was rejected


STAGE_THREADS = 8


class GroupStager:
    """`sources`: per document a StagedSource (bytes arriving group by group) or a HotSource (its layers already
    verified in host memory, taken group by group in the same order). `groups`: the layer groups (default: the
    StagedSources' grouping, which every StagedSource shares; required where every document is hot).

    Staging threads only verify, parse and pin (host work). The device copies are the hot path's: on CUDA,
    `documents()` hands the staged layers to a `LayerPrefetcher`, which packs every document's layer into ONE
    device buffer from the compute stream's pool, one copy per document, one layer ahead on its copy stream, so the
    engine reads every document's rows of a field through one view (`views.rows_view`), as on a tier hit. (Copies
    issued tensor by tensor per document from the staging threads, each from the copy stream's own pool, gave the
    engine per-document layers and the allocator a second pool.)"""

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
        self._futures: list[list[Future]] = []
        self._agreed = -1                               # groups 0.._agreed passed the cross-rank agreement
        self._consumed: set[int] = set()
        self._count = threading.Lock()
        self._left = [len(self.sources)] * len(self.groups)       # per group: documents not yet staged
        self._noted: set[int] = set()
        self._groups_done: dict[int, _Staged] = {}
        # (group, document) parts are staged STAGE_THREADS at a time (parsing makes views; pinning copies, which
        # releases the GIL)
        self._pool = ThreadPoolExecutor(STAGE_THREADS, thread_name_prefix="stage")

    def start(self) -> "GroupStager":
        """Stage every (group, document) in group order, each as soon as its bytes arrived; never waits. Documents
        of one group are staged in parallel (the fetch delivers them group-major too, `Prefetcher.open_all`), so
        group 0 of every document is on the host first and the forward starts while later groups arrive."""
        self._futures = [[self._pool.submit(self._stage, g, j) for j in range(len(self.sources))]
                         for g in range(len(self.groups))]
        self._pool.shutdown(wait=False)
        return self

    def _note(self, event: str, group: int) -> None:
        if self.trace is not None:
            self.trace.add(event, group)

    def _stage(self, g: int, j: int) -> tuple[list[LayerArtifact] | None, Verdict]:
        """Document j's layers of group g, verified, parsed and pinned; the last of the group to finish notes
        `staged` (a rejected document notes it at once: the group's verdict is known)."""
        src = self.sources[j]
        if isinstance(src, HotSource):
            out = [src.doc.layers[i] for i in self.groups[g]], Verdict.accept()
        else:
            out = src.read(g, self.heads[j])
        with self._count:
            self._left[g] -= 1
            if (self._left[g] == 0 or not out[1].ok) and g not in self._noted:
                self._noted.add(g)
                self._note("staged", g)
        return out

    def _group(self, g: int) -> _Staged:
        """Group g once every document's part is staged: the first reject in document order, else its layers."""
        if g not in self._groups_done:
            parts = [f.result() for f in self._futures[g]]
            bad = next((j for j, (_, v) in enumerate(parts) if not v.ok), None)
            self._groups_done[g] = _Staged(parts[bad][1], document=bad) if bad is not None else \
                _Staged(Verdict.accept(), [arts for arts, _ in parts])
        return self._groups_done[g]

    def group_of(self, layer: int) -> int:
        return next(g for g, r in enumerate(self.groups) if layer in r)

    def get(self, layer: int) -> list[LayerArtifact]:
        """Every document's layer `layer` in host memory, verified and agreed on by every rank; raises
        StagingRejected. Waits (host side) until its group was staged."""
        g = self.group_of(layer)
        while self._agreed < g:                 # groups are agreed in order, each once, on every rank alike
            h = self._agreed + 1
            own = self._group(h)
            verdict = agree(own.verdict, self.control)
            if not verdict.ok:
                raise StagingRejected(h, verdict, own.document)
            self._agreed = h
        st = self._group(g)
        if g not in self._consumed:
            self._consumed.add(g)
            self._note("ready", g)
            self._note("consume", g)
        i = layer - self.groups[g].start
        return [arts[i] for arts in st.layers]

    def documents(self) -> list[DocumentArtifact]:
        """The documents whose `layers[i]` comes through `get(i)`: on CUDA staged to the device by a
        `LayerPrefetcher` (this request's own copies, `Owner.REQUEST`), elsewhere the host layers as they are
        (`Owner.CALLER`)."""
        docs = [h.document(_GroupLayers(self, j)) for j, h in enumerate(self.heads)]
        return LayerPrefetcher(docs, self.device).documents() if self.device.type == "cuda" else docs


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
