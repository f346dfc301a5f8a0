"""Local-filesystem blob backend, the embedded default: one file per blob under
`root/blobs/<tenant>/<doc_id>/<digest[:2]>/<digest>`, uploads staged in `root/spool/`.

A blob appears by rename of a file that was written and fsynced first, then the directory is fsynced,
so a crash leaves either the whole blob or none of it (plus, at worst, a spool file GC removes)."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import BinaryIO

from .blob import BlobKey, BlobMissing, BlobUnavailable
from .keys import HEX64


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FilesystemBlobs:
    name = "fs"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.blobs = self.root / "blobs"
        self.spool = self.root / "spool"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.spool.mkdir(parents=True, exist_ok=True)

    def path(self, key: BlobKey) -> Path:
        p = self.blobs.joinpath(*key.parts())
        assert p.is_relative_to(self.blobs), p        # BlobKey's checks make this impossible; keep it so
        return p

    def spool_dir(self) -> Path:
        return self.spool

    def put_file_blocking(self, key: BlobKey, path: Path) -> None:
        dest = self.path(key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            # replace even when present: the new file is verified, an existing one may have rotted
            os.replace(path, dest)
            fsync_dir(dest.parent)
        except OSError as e:
            raise BlobUnavailable(f"fs: cannot publish blob {key.digest[:16]}: {e}") from e

    def open_blocking(self, key: BlobKey) -> BinaryIO:
        try:
            return open(self.path(key), "rb", buffering=0)
        except FileNotFoundError:
            raise BlobMissing(key.digest) from None
        except OSError as e:
            raise BlobUnavailable(f"fs: cannot open blob {key.digest[:16]}: {e}") from e

    def size_blocking(self, key: BlobKey) -> int | None:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            return None

    def delete_blocking(self, key: BlobKey) -> int:
        p = self.path(key)
        try:
            size = p.stat().st_size
            p.unlink()
        except FileNotFoundError:
            return 0
        return size

    def list_blocking(self, tenant: str, doc_id: str) -> list[tuple[str, int]]:
        base = self.path(BlobKey(tenant, doc_id, "0" * 64)).parent.parent
        out = []
        if base.is_dir():
            for sub in base.iterdir():
                for f in sub.iterdir():
                    if HEX64.match(f.name):
                        try:
                            out.append((f.name, f.stat().st_size))
                        except FileNotFoundError:
                            pass
        return out

    def remove_stale_spool_blocking(self, older_than_s: float) -> int:
        cutoff, n = time.time() - older_than_s, 0
        for f in self.spool.iterdir():
            try:
                if f.stat().st_mtime < cutoff:
                    f.unlink()
                    n += 1
            except FileNotFoundError:
                pass
        return n
