"""The host-memory tier: whole artifact directories of this rank (a tmpfs under /dev/shm by default), least
recently used evicted first, never one a running request holds. Entries are keyed by (tenant, store doc id,
generation) and are complete by construction: the fetcher publishes a directory with one rename, certificate
written last. `runtime.reuse.store.load_artifact` re-verifies every digest on every use, so a byte that rots
here is a counted fallback (digest_mismatch), after which the entry is dropped and fetched again."""
from __future__ import annotations

import shutil
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

TierKey = tuple[str, str, int]          # tenant, store doc id, generation


@dataclass
class _Entry:
    path: Path
    nbytes: int
    pins: int = 0


class HostTier:
    def __init__(self, root: str | Path, capacity_bytes: int):
        self.root = Path(root)
        shutil.rmtree(self.root, ignore_errors=True)      # a cache: nothing survives a restart, no partial dirs
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[TierKey, _Entry] = OrderedDict()
        self.used = 0
        self.hits = self.misses = 0

    def lookup(self, key: TierKey, *, count: bool = True) -> Path | None:
        """The entry's directory, pinned until `release`; counted as a hit or a miss."""
        with self._lock:
            e = self._entries.get(key)
            if count:
                if e is None:
                    self.misses += 1
                else:
                    self.hits += 1
            if e is None:
                return None
            self._entries.move_to_end(key)
            e.pins += 1
            return e.path

    def older(self, tenant: str, doc_id: str) -> tuple[TierKey, Path] | None:
        """The newest entry of this document at any generation, pinned (a request whose document has no current
        generation hands it to the certificate check, which names it stale)."""
        with self._lock:
            found = [k for k in self._entries if k[:2] == (tenant, doc_id)]
            if not found:
                return None
            key = max(found, key=lambda k: k[2])
            self._entries[key].pins += 1
            return key, self._entries[key].path

    def staging_dir(self, key: TierKey) -> Path:
        """A fresh path for a fetch to publish into (it must not exist yet)."""
        return self.root / f"{key[0]}-{key[1]}-g{key[2]}-{uuid.uuid4().hex[:8]}"

    def insert(self, key: TierKey, path: Path, nbytes: int) -> Path:
        """Add a published directory (unpinned); returns the entry's directory (an existing one wins)."""
        with self._lock:
            if key in self._entries:
                shutil.rmtree(path, ignore_errors=True)
                return self._entries[key].path
            self._entries[key] = _Entry(path, nbytes)
            self.used += nbytes
            self._evict_over_capacity()
            return path

    def release(self, key: TierKey) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.pins > 0:
                e.pins -= 1
            self._evict_over_capacity()

    def drop(self, key: TierKey) -> None:
        """Forget an entry (it failed verification); its directory goes once no request holds it."""
        with self._lock:
            e = self._entries.pop(key, None)
            if e is not None:
                self.used -= e.nbytes
                shutil.rmtree(e.path, ignore_errors=True)

    def _evict_over_capacity(self) -> None:
        # the most recent entry is never evicted: it was just fetched or used (even one larger than the tier)
        for key in list(self._entries)[:-1]:
            if self.used <= self.capacity:
                return
            e = self._entries[key]
            if e.pins == 0:
                del self._entries[key]
                self.used -= e.nbytes
                shutil.rmtree(e.path, ignore_errors=True)

    def keys(self) -> list[TierKey]:
        with self._lock:
            return list(self._entries)

    def take_counts(self) -> tuple[int, int]:
        with self._lock:
            out = (self.hits, self.misses)
            self.hits = self.misses = 0
            return out
