"""Fetch over the store's local socket (local_server.py): the co-located fast path of `StoreClient.fetch`.

    client = LocalStoreClient("/run/redknot/store.sock", token)     # or StoreClient(target, token, local_socket=...)
    for shard in client.fetch(key, rank, layers=Range(8, 12)):
        ...

The store answers a selection with the shards' specs and open read-only descriptors of their blobs; this
client reads each descriptor (with `threads` > 1 in a small pool, shards in parallel: `os.pread` and blake3
both release the GIL) and checks the BLAKE3 digest of exactly the bytes it returns, on every fetch. It reads into a
fresh `bytes` rather than returning an mmap: a mapping would change under the caller if the file changed and
raise SIGBUS on an I/O error or truncation, where a read fails with an exception.

`fetch_into` reads each shard straight into buffers the caller names from the descriptor and the spec (the worker
puts each tensor's bytes at its place in a page-locked slab, runtime.reuse.direct), with the same checks.

A digest mismatch raises DataLoss (the gRPC path's error) after reporting the shard to the store, which hashes
the blob again and, if it really is corrupt, moves `redknot_store_digest_failures_total{stage="read"}`; a
missing or truncated blob is refused by the store itself (DataLoss, counted there). Same signature, same
results and same errors as `StoreClient.fetch`; `verify` is accepted for that signature but this path always
verifies, since no server-side check stands behind it."""
from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import blake3

from . import local_wire
from .core import FetchParams
from .errors import DataLoss, NoLocalStore, StoreError, Unavailable
from .keys import DocumentKey, FetchedShard, Range, ShardSpec

PARALLEL_HASH_BYTES = 1 << 20       # shards from this size are hashed with blake3's threads as well


def _verify(spec: ShardSpec, got: int, longer: bool, parts: list, parallel_hash: bool) -> None:
    """DataLoss unless the blob held exactly `spec.size` bytes (`got` read, `longer` if it goes on past them) and
    `parts`, in order, hash to `spec.digest`."""
    if got != spec.size or longer:
        raise DataLoss(f"shard {spec.name!r} (rank {spec.rank}) is corrupt: its blob holds "
                       f"{'more than ' if longer else ''}{got} bytes, committed {spec.size}")
    h = blake3.blake3(max_threads=blake3.blake3.AUTO if parallel_hash and spec.size >= PARALLEL_HASH_BYTES else 1)
    for part in parts:
        h.update(part)
    if h.hexdigest() != spec.digest:
        raise DataLoss(f"shard {spec.name!r} (rank {spec.rank}) is corrupt: its bytes do not hash to the committed "
                       f"digest {spec.digest[:16]}")


def read_verified(fd: int, spec: ShardSpec, parallel_hash: bool = True) -> bytes:
    """The blob's bytes, or DataLoss if they are not exactly `spec.size` bytes hashing to `spec.digest`."""
    parts, offset = [], 0
    while offset <= spec.size:              # one byte past the declared size, so a longer blob is seen too
        chunk = os.pread(fd, spec.size + 1 - offset, offset)
        if not chunk:
            break
        parts.append(chunk)
        offset += len(chunk)
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    longer = len(data) > spec.size
    _verify(spec, min(len(data), spec.size), longer, [data], parallel_hash)
    return data


def _preadv_full(fd: int, buffers: list, offset: int) -> int:
    """Fill `buffers` in order from `fd` at `offset` (one preadv, more where a read comes back short); the bytes
    read (fewer than the buffers hold only at the end of the file)."""
    views = [m for m in (memoryview(b).cast("B") for b in buffers) if len(m)]
    total = 0
    while views:
        n = os.preadv(fd, views[:1024], offset)      # IOV_MAX
        if n == 0:
            break
        offset += n
        total += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total


# where a caller puts a shard's bytes: (descriptor, spec) -> (the prefix it read itself, buffers for the rest)
Place = Callable[[int, ShardSpec], tuple[bytes, list]]


def read_placed(fd: int, spec: ShardSpec, place: Place, parallel_hash: bool = True) -> None:
    """The blob's bytes put where `place` says (its prefix, then its buffers, in file order), or DataLoss if they
    are not exactly `spec.size` bytes hashing to `spec.digest` (the caller then must not use the buffers)."""
    prefix, buffers = place(fd, spec)
    want = spec.size - len(prefix)
    room = sum(memoryview(b).nbytes for b in buffers)
    if want < 0 or room != want:
        raise ValueError(f"shard {spec.name!r}: {len(prefix)} + {room} bytes placed for {spec.size}")
    got = len(prefix) + _preadv_full(fd, buffers, len(prefix))
    _verify(spec, got, got == spec.size and bool(os.pread(fd, 1, spec.size)), [prefix, *buffers], parallel_hash)


class LocalStoreClient:
    def __init__(self, path: str | os.PathLike, token: str, *, timeout_s: float = 60.0, threads: int | None = None,
                 parallel_hash: bool = True):
        """`threads`: shards read and hashed at once (default: half the cores, at most 8, leaving the rest to
        blake3's own threads); `parallel_hash`: hash shards of PARALLEL_HASH_BYTES or more with blake3's threads.
        bench/store.py measures the combinations."""
        self.path, self.token, self.timeout_s = os.fspath(path), token, timeout_s
        self.threads = threads or max(1, min(8, (os.cpu_count() or 1) // 2))
        self.parallel_hash = parallel_hash
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="local-fetch") if self.threads > 1 else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> "LocalStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _connect(self) -> socket.socket:
        s = local_wire.new_socket()
        s.settimeout(self.timeout_s)
        try:
            s.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            s.close()
            raise NoLocalStore(f"local socket {self.path}: {e}") from None
        except OSError as e:
            s.close()
            raise Unavailable(f"local socket {self.path}: {e}") from None
        return s

    def _call(self, s: socket.socket, op: str, p: FetchParams) -> None:
        try:
            s.send(local_wire.request_bytes(op, self.token, p))
        except OSError as e:
            raise Unavailable(f"local socket {self.path}: {e}") from None

    def _recv(self, s: socket.socket) -> tuple[dict, list[int]]:
        try:
            raw, fds, flags, _ = socket.recv_fds(s, local_wire.MAX_FRAME + 1, local_wire.BATCH)
        except OSError as e:                # includes the timeout
            raise Unavailable(f"local socket {self.path}: {e}") from None
        try:
            if not raw:
                raise Unavailable(f"local socket {self.path}: the store closed the connection")
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise StoreError(f"local socket {self.path}: a reply frame arrived truncated")
            return local_wire.unpack_reply(raw), fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def fetch(self, key: DocumentKey, rank: int, *, generation: int = 0, layers: Range | None = None,
              channels: Range | None = None, names: Sequence[str] = (), verify: bool = True
              ) -> Iterator[FetchedShard]:
        """Shards of one rank of one generation (the current one by default, resolved once by the store), each
        read and verified here; `verify` is ignored (always on), see the module docstring."""
        return self._fetch(key, rank, FetchParams(key, generation, rank, layers, channels, tuple(names)),
                           lambda fd, spec: read_verified(fd, spec, self.parallel_hash))

    def fetch_into(self, key: DocumentKey, rank: int, place: Place, *, generation: int = 0,
                   layers: Range | None = None, channels: Range | None = None, names: Sequence[str] = ()
                   ) -> Iterator[FetchedShard]:
        """`fetch`, each shard's bytes read straight into the caller's buffers (`place(fd, spec)`: the prefix it
        read itself and where the rest goes; `read_placed`) and verified there: no `bytes` is made. Yields each
        shard (its `data` None) once its bytes are in place and verified; the same errors as `fetch`."""
        return self._fetch(key, rank, FetchParams(key, generation, rank, layers, channels, tuple(names)),
                           lambda fd, spec: read_placed(fd, spec, place, self.parallel_hash))

    def _fetch(self, key: DocumentKey, rank: int, params: FetchParams, read) -> Iterator[FetchedShard]:
        with self._connect() as s:
            self._call(s, "fetch", params)
            while True:
                d, fds = self._recv(s)
                specs = local_wire.shards_of(d)
                ahead: dict[int, Future] = {}     # at most `threads` shards read ahead of the caller
                try:
                    if len(fds) != len(specs):
                        raise StoreError(f"a reply frame carries {len(fds)} descriptors for {len(specs)} shards")
                    for i, spec in enumerate(specs):
                        try:
                            if self._pool is None:
                                data = read(fds[i], spec)
                            else:
                                for j in range(i, min(i + self.threads, len(specs))):
                                    if j not in ahead:
                                        ahead[j] = self._pool.submit(read, fds[j], specs[j])
                                data = ahead.pop(i).result()
                        except DataLoss as e:
                            raise DataLoss(f"{e} ({self._report(key, d['generation'], spec)})") from None
                        yield FetchedShard(spec, d["generation"], data)
                finally:
                    for f in ahead.values():
                        f.cancel()
                    wait(ahead.values())
                    for fd in fds:
                        os.close(fd)
                if d["last"]:
                    return

    def _report(self, key: DocumentKey, generation: int, spec: ShardSpec) -> str:
        """Tell the store which shard failed its digest here; it re-hashes the blob and counts a real failure."""
        try:
            with self._connect() as s:
                self._call(s, "report", FetchParams(key, generation, spec.rank, names=(spec.name,)))
                d, fds = self._recv(s)
                for fd in fds:
                    os.close(fd)
        except StoreError as e:
            return f"not reported to the store: {e}"
        return "the store confirmed it" if d.get("confirmed") else "the store found its blob intact"
