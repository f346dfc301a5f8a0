"""The blob backend interface: content-addressed shard bytes, namespaced by tenant and document.

Every method is blocking (the async core calls them through `asyncio.to_thread`) and works on one blob,
except `list_blocking`. Backends only move bytes: digests are checked above them, in `core.py`, on every
write and every read, so a backend never needs to be trusted. Errors: `BlobMissing` for an absent blob,
`BlobUnavailable` for anything else the backend cannot do now (the core maps it to UNAVAILABLE)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from .keys import check_digest, check_name, check_tenant


class BlobMissing(Exception):
    """The blob is not there. For a committed shard this is data loss (the core says so)."""


class BlobUnavailable(Exception):
    """The backend failed for a reason other than a missing blob (I/O error, network, credentials)."""


@dataclass(frozen=True)
class BlobKey:
    tenant: str
    doc_id: str
    digest: str

    def __post_init__(self):
        # every part becomes a path component or object-key part: check again at this boundary
        check_tenant(self.tenant)
        check_name("doc_id", self.doc_id)
        check_digest("digest", self.digest)

    def parts(self) -> tuple[str, str, str, str]:
        return (self.tenant, self.doc_id, self.digest[:2], self.digest)


class BlobBackend(Protocol):
    name: str

    def spool_dir(self) -> Path:
        """Where uploads are staged before `put_file_blocking` (same filesystem as the blobs for `fs`)."""

    def put_file_blocking(self, key: BlobKey, path: Path) -> None:
        """Publish the verified, fsynced file at `path` as `key`, atomically (readers see all of it or nothing),
        consuming `path`. Idempotent: the same key always holds the same bytes."""

    def open_blocking(self, key: BlobKey) -> BinaryIO:
        """A reader positioned at the blob's first byte; the caller closes it. BlobMissing if absent."""

    def size_blocking(self, key: BlobKey) -> int | None:
        """The stored size, or None if absent."""

    def delete_blocking(self, key: BlobKey) -> int:
        """Remove the blob; returns the bytes freed (0 when it was absent)."""

    def list_blocking(self, tenant: str, doc_id: str) -> list[tuple[str, int]]:
        """(digest, size) of every blob of one document."""

    def remove_stale_spool_blocking(self, older_than_s: float) -> int:
        """Delete staging files older than `older_than_s` (abandoned uploads); returns how many."""
