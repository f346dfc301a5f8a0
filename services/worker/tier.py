"""The pinned host tier: documents this rank staged, kept in its own page-locked host memory (plain memory where no
GPU exists), least recently used evicted first by bytes, never one a running request holds.

An entry is a document whose every shard was verified against its certificate when it entered (the bytes' blake3
digests, the manifest, the tensors' shapes and dtypes), parsed, and packed layer by layer into pinned slabs
(`runtime.reuse.packing.pin`): a request that finds all its documents here takes the path `bench/ttft.py`
measures, each layer copied to the GPU in one transfer one layer ahead of the forward, with no file read, parse,
digest or pin. What is checked on every use is the certificate's binding (checkpoint, tokens, profile, dtype,
producer, TP geometry, generation), against the request. Keys are (tenant, store doc id, generation)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from runtime.reuse.artifact import DocumentArtifact
from runtime.reuse.packing import layer_tensors
from runtime.reuse.store import ArtifactHead

TierKey = tuple[str, str, int]          # tenant, store doc id, generation
# why a look-up missed: never fetched (or lost with a restart), evicted for room, dropped after a failed check
MISS_REASONS = ("absent", "evicted", "dropped")
_GONE_KEPT = 4096                       # how many removed keys are remembered to name a later miss's reason


def host_bytes(doc: DocumentArtifact) -> int:
    """The host bytes `doc`'s tensors hold (each storage once: `pin` packs a document into a few slabs)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for la in doc.layers for t in layer_tensors(la)}
    return sum(storages.values())


@dataclass
class TierEntry:
    head: ArtifactHead
    doc: DocumentArtifact
    nbytes: int
    pins: int = 0


@dataclass
class TierCounts:
    hits: int = 0
    misses: dict[str, int] | None = None
    evictions: int = 0

    def __post_init__(self):
        if self.misses is None:
            self.misses = {r: 0 for r in MISS_REASONS}


class PinnedTier:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[TierKey, TierEntry] = OrderedDict()
        self._gone: OrderedDict[TierKey, str] = OrderedDict()
        self.used = 0
        self._counts = TierCounts()

    def lookup(self, key: TierKey, *, count: bool = True) -> TierEntry | None:
        """The entry, pinned until `release`; counted as a hit or a miss (with its reason)."""
        with self._lock:
            e = self._entries.get(key)
            if count:
                if e is None:
                    self._counts.misses[self._gone.get(key, "absent")] += 1
                else:
                    self._counts.hits += 1
            if e is None:
                return None
            self._entries.move_to_end(key)
            e.pins += 1
            return e

    def older(self, tenant: str, doc_id: str) -> tuple[TierKey, TierEntry] | None:
        """The newest entry of this document at any generation, pinned (a request whose document has no current
        generation hands it to the certificate check, which names it stale)."""
        with self._lock:
            found = [k for k in self._entries if k[:2] == (tenant, doc_id)]
            if not found:
                return None
            key = max(found, key=lambda k: k[2])
            self._entries[key].pins += 1
            return key, self._entries[key]

    def insert(self, key: TierKey, head: ArtifactHead, doc: DocumentArtifact) -> TierEntry:
        """Add a verified, pinned document (unpinned by requests); an existing entry for `key` wins. A tier of
        capacity 0 is off: it keeps nothing (every request fetches from the store)."""
        with self._lock:
            if self.capacity == 0:
                return TierEntry(head, doc, host_bytes(doc))
            if key in self._entries:
                return self._entries[key]
            e = self._entries[key] = TierEntry(head, doc, host_bytes(doc))
            self._gone.pop(key, None)
            self.used += e.nbytes
            self._evict_over_capacity()
            return e

    def release(self, key: TierKey) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.pins > 0:
                e.pins -= 1
            self._evict_over_capacity()

    def drop(self, key: TierKey) -> None:
        """Forget an entry (it failed a check); requests holding it keep their references until they end."""
        with self._lock:
            self._remove(key, "dropped")

    def _remove(self, key: TierKey, why: str) -> None:
        e = self._entries.pop(key, None)
        if e is None:
            return
        self.used -= e.nbytes
        self._gone[key] = why
        while len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)

    def _evict_over_capacity(self) -> None:
        # the most recent entry is never evicted: it was just fetched or used (even one larger than the tier)
        for key in list(self._entries)[:-1]:
            if self.used <= self.capacity:
                return
            if self._entries[key].pins == 0:
                self._remove(key, "evicted")
                self._counts.evictions += 1

    def keys(self) -> list[TierKey]:
        with self._lock:
            return list(self._entries)

    def take_counts(self) -> TierCounts:
        """Hits, misses by reason and evictions since the last call."""
        with self._lock:
            out, self._counts = self._counts, TierCounts()
            return out
