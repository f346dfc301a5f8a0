"""`GroupStager` (the worker): one request's documents arriving layer group by layer group (from the store or the
host tier, `StagedSource`; or already verified in the tier, `HotSource`). A pool of staging threads takes each group
as soon as its bytes are there, verifies every shard against the already validated certificate (`read_layers`) and
pins it (`pin_layers`; both once per fetch, shared with the worker's tier: `StagedSource.read`), and on CUDA issues
its host->device copies on a side stream, then records the group's CUDA event; on CPU the same pipeline runs with
threads and no copies. The forward asks for layer i; the stager waits (host side) only until group(i) was staged,
lets the TP ranks agree on that group's verdict (one small collective on the control group, the same point on every
rank), then makes the compute stream wait on the group's event. A group any rank rejected raises `StagingRejected`
on every rank at the same layer: the caller restarts the request in the recompute arm (docs/services.md).

Ownership: a device copy made here is this request's own (`Owner.REQUEST`, overlaid in place); on CPU the layers
are the tier's (`Owner.CALLER`, as `pin_layers` made them), which the engine copies before writing."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from runtime.model.parallel import Parallel
from .artifact import DocumentArtifact, LayerArtifact, Owner
from .certificate import FallbackReason, Verdict, agree
from .packing import map_layer, pin_layers
from .store import ArtifactHead, read_layers


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
            staged = [[map_layer(la, copy, Owner.REQUEST) for la in arts] for arts in per_doc]
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
                        map_layer(la, lambda t: (t.record_stream(cur), t)[1])
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
