"""This rank's documents, from its pinned host tier or the store, layer group by layer group, ahead of need.

A tier hit hands the request a `HotSource` (verified layers in pinned host memory). Otherwise a rank asks the
store only for its own shards: its rank's certificate and manifest (the head), then every layer group's latent
shards and the LOCAL shards inside its channel range, each layer group on its own stream. `open` hands the
request a `StagedSource` at once: futures for the head and for each group, which the forward consumes as they
complete (`runtime.reuse.stager.GroupStager`), so layer group g runs while g+1 is still arriving. A document
fetched whole is verified (every shard against its certificate), parsed and pinned (once, shared with the
request's stager: `StagedSource.read`) and published into the tier.
Rank 0 broadcasts the documents of the requests queued behind the current one; every rank starts fetching those
in the background while the current request runs (`warm`), and a request joins a fetch already in flight
instead of starting another.
Under TP the ranks first agree (one control-group all-gather per call) which documents none of them holds or is
fetching: those are fetched shared (services/worker/exchange.py: each rank fetches the latent shards of the layers
it owns plus its own LOCAL shards, and the group all-gathers the latent shards); a document some rank already
holds is fetched whole, alone, by each rank that lacks it (no collective, so no rank waits on another's tier)."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from runtime.reuse.certificate import FallbackReason, Verdict
from runtime.reuse.direct import DirectGroup
from runtime.reuse.stager import HotSource, SourceError, StagedSource, Trace
from runtime.model.parallel import Parallel
from runtime.reuse.store import CERTIFICATE_FILE, MANIFEST_FILE, VerifiedFiles, read_head, shard_file
from services.common.tenants import Tenants
from services.store.client import StoreClient, TlsConfig, fallback_reason
from services.store.errors import NoLocalStore, StoreError
from services.store.keys import DocumentKey, Range

from .exchange import ShardExchange
from .tier import PinnedTier, TierKey

log = logging.getLogger("redknot.worker")
HEAD_FILES = (CERTIFICATE_FILE, MANIFEST_FILE)


@dataclass
class FetchStats:
    bytes: int = 0                                           # from the store
    seconds: list[float] = field(default_factory=list)      # one per document fetched
    exchanged: int = 0                                       # from the other ranks of the TP group (shared shards)
    placed: int = 0                     # of `bytes`, read straight into the tier's slabs (the local socket's path)


@dataclass(frozen=True)
class Opened:
    """A request's handle on one document: its source, and the tier entry it pinned (None: from the store,
    then `published` completes once the fetch is in the tier, or failed)."""
    source: StagedSource | HotSource
    pinned: TierKey | None
    published: Future | None = None


def _nbytes(part: dict | DirectGroup) -> int:
    """The bytes of one fetched part of a document: files (name -> bytes) or a group read into slabs."""
    return part.nbytes if isinstance(part, DirectGroup) else sum(len(d) for d in part.values())


class _Head:
    """A document's head (its certificate and manifest files, a future), verified once by whichever of its layer
    groups needs it first (`read_head` without a binding: the request's checks come later, in `StagedSource.read`)."""

    def __init__(self, files: Future):
        self.files, self._lock, self._read = files, threading.Lock(), None

    def verified(self):
        with self._lock:
            if self._read is None:
                self._read = read_head(self.files.result(), None)
        art, v = self._read
        if not v.ok:
            raise SourceError(v.reason, v.detail)
        return art


class Prefetcher:
    def __init__(self, tier: PinnedTier, tenants: Tenants, store: str, rank: int, channels: tuple[int, int],
                 n_layers: int, layer_group: int, threads: int, trace: Trace | None = None, local_socket: str = "",
                 exchange: ShardExchange | None = None, control: Parallel | None = None,
                 tls: TlsConfig | None = None):
        self.tier, self.tenants, self.store, self.rank, self.trace = tier, tenants, store, rank, trace
        if exchange is not None and (control is None or control.size != exchange.size):
            raise ValueError("a shard exchange needs the TP group's control collectives (control.size == TP)")
        self.exchange, self.control = exchange, control
        self.local_socket = local_socket or None
        self._warned_local = False
        self.tls = tls                                      # TLS (mTLS) to the store over gRPC; None: plaintext
        self.channels = Range(*channels)
        self.groups = [Range(a, min(a + layer_group, n_layers)) for a in range(0, n_layers, layer_group)]
        self._publish = ThreadPoolExecutor(max(1, threads // 2), thread_name_prefix="fetch-doc")
        self._streams = ThreadPoolExecutor(threads, thread_name_prefix="fetch-group")
        self._lock = threading.Lock()
        self._inflight: dict[TierKey, tuple[StagedSource, Future]] = {}
        self._clients: dict[str, StoreClient] = {}
        self.stats = FetchStats()

    def _client(self, tenant: str) -> StoreClient:
        with self._lock:
            if tenant not in self._clients:
                self._clients[tenant] = StoreClient(self.store, self.tenants.token(tenant), timeout_s=120,
                                                     local_socket=self.local_socket, tls=self.tls)
            return self._clients[tenant]

    def _note(self, event: str, group: int) -> None:
        if self.trace is not None:
            self.trace.add(event, group)

    # ------------------------------------------------------------------------------------------- the store
    def _stream(self, tenant: str, key: DocumentKey, generation: int, group: int | None,
                names: list[str] | None = None) -> dict[str, bytes]:
        """One stream of shards (the head when `group` is None; with `names`, only those of the group); a store
        error becomes the SourceError that names this rank's fallback reason."""
        self._note("fetch_start", -1 if group is None else group)
        sel = dict(names=list(HEAD_FILES)) if group is None else dict(layers=self.groups[group], channels=self.channels)
        if names is not None:
            if not names:                                   # nothing of this group is this rank's to fetch
                self._note("fetch_done", group)
                return VerifiedFiles()
            sel["names"] = names
        try:
            shards = list(self._client(tenant).fetch(key, self.rank, generation=generation, **sel))
        except StoreError as e:
            raise SourceError(FallbackReason(fallback_reason(e).value),
                              f"{key.doc_id} generation {generation}: {type(e).__name__}: {e}") from None
        self._note("fetch_done", -1 if group is None else group)
        with self._lock:
            self.stats.bytes += sum(len(s.data) for s in shards)
        # the client checked every shard against the store's digest (gRPC: verify on; the local socket: always), so
        # read_layers compares digests with the certificate's instead of hashing each byte again
        return VerifiedFiles({s.spec.name: s.data for s in shards}, {s.spec.name: s.spec.digest for s in shards})

    def _direct(self, tenant: str, key: DocumentKey, generation: int, group: int, head: _Head
                ) -> DirectGroup | VerifiedFiles:
        """One layer group through the local socket, read straight into the slabs of its layers
        (runtime.reuse.direct: their layout follows from the head's manifest, verified first; page-locked where a
        GPU exists, so the tier keeps them and the device copy reads them as they are); the byte stream
        (`_stream`) where the store has no local socket here."""
        head_art = head.verified()
        g = self.groups[group]
        direct = DirectGroup(head_art, range(g.lo, g.hi), pinned=torch.cuda.is_available())
        self._note("fetch_start", group)
        try:
            for s in self._client(tenant).local.fetch_into(
                    key, self.rank, lambda fd, spec: direct.place(fd, spec.name, spec.size), generation=generation,
                    layers=g, channels=self.channels):
                direct.verified(s.spec.name, s.spec.digest)
        except NoLocalStore as e:                   # raised at connect, before any shard was read
            if not self._warned_local:
                self._warned_local = True
                log.warning("%s: fetching over gRPC instead", e)
            return self._stream(tenant, key, generation, group)
        except StoreError as e:
            raise SourceError(FallbackReason(fallback_reason(e).value),
                              f"{key.doc_id} generation {generation}: {type(e).__name__}: {e}") from None
        self._note("fetch_done", group)
        with self._lock:
            self.stats.bytes += direct.nbytes
            self.stats.placed += direct.nbytes
        return direct

    def _own_share(self, tenant: str, key: DocumentKey, generation: int, group: int, head: _Head) -> dict:
        """This rank's part of a shared fetch of one layer group: its LOCAL shards and the latent shards of the
        layers it owns, named by its manifest (the head, verified first)."""
        head_art = head.verified()
        layers = range(self.groups[group].lo, self.groups[group].hi)
        skip = self.exchange.shared_files(layers) - self.exchange.owned_files(layers)
        names = sorted({shard_file(e["name"]) for e in head_art.manifest["shards"] if e["layer"] in layers} - skip)
        return self._stream(tenant, key, generation, group, names)

    def _fetch_all(self, items: list[tuple[str, DocumentKey, int, bool]]) -> list[StagedSource]:
        """Start fetching (tenant, key, generation, shared) documents: every head first, then layer group by layer
        group across the documents (group 0 of every document, then group 1, ...), so the forward's first groups
        arrive first whatever the number of documents (document by document, group 0 of the last one came with the
        last bytes and the forward waited for nearly the whole fetch)."""
        heads = [self._streams.submit(self._stream, t, k, gen, None) for t, k, gen, _ in items]
        checked = [_Head(h) for h in heads]         # each document's head verified once for all its groups
        groups: list[list[tuple[range, Future]]] = [[] for _ in items]
        for i, g in enumerate(self.groups):
            layers = range(g.lo, g.hi)
            for d, ((t, k, gen, shared), head) in enumerate(zip(items, checked)):
                if shared:      # every rank runs this, in the same order: the exchange jobs line up
                    fut = self.exchange.submit(self._streams.submit(self._own_share, t, k, gen, i, head), layers)
                elif self.local_socket is not None:
                    fut = self._streams.submit(self._direct, t, k, gen, i, head)
                else:
                    fut = self._streams.submit(self._stream, t, k, gen, i)
                groups[d].append((layers, fut))
        return [StagedSource(h, tuple(gs)) for h, gs in zip(heads, groups)]

    def _publish_when_done(self, tkey: TierKey, src: StagedSource, t0: float) -> None:
        """Once every stream of a fetch arrived: every shard verified against the certificate, the document parsed
        and pinned, into the tier (a failed or corrupt fetch publishes nothing; the request that needed it has its
        reason from the source or its own verification)."""
        try:
            head_files = src.head.result()
            nbytes = sum(_nbytes(part) for part in (head_files, *(g.result() for _, g in src.groups)))
            with self._lock:
                self.stats.seconds.append(time.perf_counter() - t0)
            if self.tier.capacity == 0:                 # the tier is off: nothing is kept, nothing to prepare
                return
            head, v = read_head(head_files, None)
            # the request's stager reads the same groups: each verified, parsed and pinned once for both
            layers, v = src.read_all(head) if v.ok else (None, v)
            if v.ok and len(layers) != head.manifest["n_layers"]:
                v = Verdict.reject(FallbackReason.MISSING_SHARD, f"{len(layers)} layers fetched of "
                                                                  f"{head.manifest['n_layers']}")
            if not v.ok:
                log.warning("rank %d: %s not kept: %s: %s", self.rank, tkey, v.reason.value, v.detail)
                return
            self.tier.insert(tkey, head, head.document(layers))       # pinned already, by `src.read`
            log.info("rank %d fetched %s generation %d: %d bytes", self.rank, tkey[1], tkey[2], nbytes)
        except SourceError as e:
            log.info("rank %d: fetch of %s failed: %s", self.rank, tkey, e)
        finally:
            with self._lock:
                self._inflight.pop(tkey, None)

    def _start_all(self, items: list[tuple[str, DocumentKey, int, bool]]) -> list[tuple[StagedSource, Future]]:
        """Each (tenant, key, generation, shared) document's fetch and its tier publication: joined where already in
        flight, started (together, `_fetch_all`) where not."""
        with self._lock:
            new: dict[TierKey, tuple] = {}
            for t, k, gen, shared in items:
                tkey = (t, k.doc_id, gen)
                if tkey not in self._inflight and tkey not in new:
                    new[tkey] = (t, k, gen, shared)
            t0 = time.perf_counter()
            for tkey, src in zip(new, self._fetch_all(list(new.values()))):
                self._inflight[tkey] = src, self._publish.submit(self._publish_when_done, tkey, src, t0)
            return [self._inflight[(t, k.doc_id, gen)] for t, k, gen, _ in items]

    # ------------------------------------------------------------------------------------------- requests
    def _lacks(self, tkey: TierKey) -> bool:
        """Neither in the tier nor in flight on this rank."""
        if self.tier.lookup(tkey, count=False) is not None:
            self.tier.release(tkey)
            return False
        with self._lock:
            return tkey not in self._inflight

    def _shared(self, lacks: list[bool]) -> list[bool]:
        """Per document: whether every rank of the group lacks it (then it is fetched shared). A collective on the
        control group: called on every rank, in the same order (the request path and its warm-up hints)."""
        if self.exchange is None or not lacks:
            return [False] * len(lacks)
        every = self.control.all_gather_object(lacks)
        return [all(col) for col in zip(*every)]

    def warm(self, docs: list[tuple[str, DocumentKey, int]]) -> None:
        """Start fetching what the tier lacks of (tenant, key, generation); never waits, never raises (a failed
        warm-up is fetched again, and then counted, by the request that needs it). Under TP a collective: every
        rank calls it with the same documents."""
        docs = [d for d in docs if d[2] > 0]
        lacks = [self._lacks((tenant, key.doc_id, gen)) for tenant, key, gen in docs]
        self._start_all([(tenant, key, gen, shared) for (tenant, key, gen), lack, shared
                         in zip(docs, lacks, self._shared(lacks)) if lack])

    def open_all(self, docs: list[tuple[str, DocumentKey, int]]) -> list[Opened]:
        """Each (tenant, key, generation) document's source: its tier entry (pinned: `tier.release(opened.pinned)`
        when done) or a fetch from the store (joined when already in flight; those started here are fetched
        together, group-major: `_fetch_all`). Never waits and never raises: failures arrive through the sources'
        futures. Under TP a collective: every rank opens the same documents in the same order."""
        tkeys = [(tenant, key.doc_id, gen) for tenant, key, gen in docs]
        entries = [self.tier.lookup(tkey) for tkey in tkeys]
        with self._lock:
            lacks = [e is None and tkey not in self._inflight for e, tkey in zip(entries, tkeys)]
        shared = self._shared(lacks)
        started = iter(self._start_all([(t, k, gen, sh) for (t, k, gen), e, sh in zip(docs, entries, shared)
                                        if e is None]))
        out = []
        for tkey, e in zip(tkeys, entries):
            if e is not None:
                out.append(Opened(HotSource(e.head, e.doc), tkey))
            else:
                src, published = next(started)
                out.append(Opened(src, None, published))
        return out

    def open(self, tenant: str, key: DocumentKey, generation: int) -> Opened:
        """`open_all` of one document."""
        return self.open_all([(tenant, key, generation)])[0]

    def open_older(self, tenant: str, key: DocumentKey) -> Opened | None:
        """The newest tier entry of a document that has no current generation (the certificate check names it
        stale), pinned; None when the tier has none."""
        older = self.tier.older(tenant, key.doc_id)
        return None if older is None else Opened(HotSource(older[1].head, older[1].doc), older[0])

    def failed(self, reason: FallbackReason, detail: str) -> StagedSource:
        """A source that delivers nothing: the request meets `reason` when it reads the head."""
        fut: Future = Future()
        fut.set_exception(SourceError(reason, detail))
        return StagedSource(fut, tuple((range(g.lo, g.hi), fut) for g in self.groups))

    def take_stats(self) -> FetchStats:
        with self._lock:
            out, self.stats = self.stats, FetchStats()
        if self.exchange is not None:
            out.exchanged = self.exchange.take_received()
        return out

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
        self._publish.shutdown(wait=False, cancel_futures=True)
        self._streams.shutdown(wait=False, cancel_futures=True)
        for c in self._clients.values():
            c.close()
