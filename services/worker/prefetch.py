"""Fetching this rank's shards from the store into the host tier, ahead of need.

A rank asks only for its own shards: its rank's certificate and manifest, then every layer group's latent
shards and the LOCAL shards inside its channel range, each layer group on its own stream so that the next
groups load while earlier ones are still arriving. Rank 0 broadcasts the documents of the requests queued
behind the current one; every rank starts fetching those in the background while the current request runs
(`warm`), and a request waits only for what is still missing (`ensure`)."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from runtime.reuse.store import CERTIFICATE_FILE, MANIFEST_FILE
from services.common.tenants import Tenants
from services.store.artifact_dir import write_rank_dir
from services.store.client import StoreClient
from services.store.errors import DataLoss, Unavailable
from services.store.keys import DocumentKey, Range

from .tier import HostTier, TierKey

log = logging.getLogger("redknot.worker")


@dataclass
class FetchStats:
    bytes: int = 0
    seconds: list[float] = field(default_factory=list)      # one per document fetched


class Prefetcher:
    def __init__(self, tier: HostTier, tenants: Tenants, store: str, rank: int, channels: tuple[int, int],
                 n_layers: int, layer_group: int, threads: int):
        self.tier, self.tenants, self.store, self.rank = tier, tenants, store, rank
        self.channels = Range(*channels)
        self.groups = [Range(a, min(a + layer_group, n_layers)) for a in range(0, n_layers, layer_group)]
        self._docs = ThreadPoolExecutor(max(1, threads // 2), thread_name_prefix="fetch-doc")
        self._streams = ThreadPoolExecutor(threads, thread_name_prefix="fetch-group")
        self._lock = threading.Lock()
        self._inflight: dict[TierKey, Future] = {}
        self._clients: dict[str, StoreClient] = {}
        self.stats = FetchStats()

    def _client(self, tenant: str) -> StoreClient:
        with self._lock:
            if tenant not in self._clients:
                self._clients[tenant] = StoreClient(self.store, self.tenants.token(tenant), timeout_s=120)
            return self._clients[tenant]

    def _fetch(self, tenant: str, key: DocumentKey, generation: int) -> None:
        """One document's shards of this rank into the tier (published whole, or not at all)."""
        t0 = time.perf_counter()
        client = self._client(tenant)

        def stream(**sel) -> list[tuple[str, bytes]]:
            return [(s.spec.name, s.data) for s in client.fetch(key, self.rank, generation=generation, **sel)]

        head = self._streams.submit(stream, names=[CERTIFICATE_FILE, MANIFEST_FILE])
        groups = [self._streams.submit(stream, layers=g, channels=self.channels) for g in self.groups]
        files = head.result() + [f for g in groups for f in g.result()]
        if not any(name == CERTIFICATE_FILE for name, _ in files):
            raise DataLoss(f"rank {self.rank} of generation {generation} has no certificate")
        tkey = (tenant, key.doc_id, generation)
        path = self.tier.insert(tkey, write_rank_dir(self.tier.staging_dir(tkey), files),
                                sum(len(d) for _, d in files))
        with self._lock:
            self.stats.bytes += sum(len(d) for _, d in files)
            self.stats.seconds.append(time.perf_counter() - t0)
        log.info("rank %d fetched %s generation %d: %d files into %s", self.rank, key.doc_id, generation,
                 len(files), path)

    def _start(self, tenant: str, key: DocumentKey, generation: int) -> Future:
        tkey = (tenant, key.doc_id, generation)
        with self._lock:
            fut = self._inflight.get(tkey)
            if fut is None:
                fut = self._docs.submit(self._fetch, tenant, key, generation)
                self._inflight[tkey] = fut
                fut.add_done_callback(lambda _f: self._forget(tkey))
            return fut

    def _forget(self, tkey: TierKey) -> None:
        with self._lock:
            self._inflight.pop(tkey, None)

    def warm(self, docs: list[tuple[str, DocumentKey, int]]) -> None:
        """Start fetching what the tier lacks of (tenant, key, generation); never waits, never raises (a failed
        warm-up is fetched again, and then counted, by the request that needs it)."""
        for tenant, key, gen in docs:
            if gen > 0 and self.tier.lookup((tenant, key.doc_id, gen), count=False) is None:
                self._start(tenant, key, gen)
            elif gen > 0:
                self.tier.release((tenant, key.doc_id, gen))

    def ensure(self, tenant: str, key: DocumentKey, generation: int):
        """The document's directory in the tier, pinned (release it with `tier.release(key)`); raises the
        store's error when it cannot be fetched."""
        tkey = (tenant, key.doc_id, generation)
        path = self.tier.lookup(tkey)
        for _ in range(3):
            if path is not None:
                return tkey, path
            self._start(tenant, key, generation).result()
            path = self.tier.lookup(tkey, count=False)        # gone again only if concurrent fetches evicted it
        raise Unavailable(f"the host tier ({self.tier.capacity} bytes) cannot keep {key.doc_id} generation "
                          f"{generation} while the request needs it")

    def take_stats(self) -> FetchStats:
        with self._lock:
            out, self.stats = self.stats, FetchStats()
            return out

    def close(self) -> None:
        self._docs.shutdown(wait=False, cancel_futures=True)
        self._streams.shutdown(wait=False, cancel_futures=True)
        for c in self._clients.values():
            c.close()
