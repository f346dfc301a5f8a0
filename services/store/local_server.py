"""The local socket: the store serves co-located readers (TP workers on the same host) open blob descriptors.

A reader sends a FetchShards selection with its bearer token (local_wire.py); the server authorizes it with the
same token table, resolves it with the same core call as the gRPC stream (`ArtifactStore.select`), opens each
blob read-only with its size checked (`ArtifactStore.open_blob`) and passes the descriptors (SCM_RIGHTS). The
reader reads and hashes the bytes itself; the bytes never cross a socket or get serialized.

Security: the socket file is 0600 (same user) or 0660 (same group); a reader needs no permission on the blob
directory, receives descriptors only for shards its own tenant's selection names, and learns nothing else
(another tenant's documents answer NotFound, exactly as over gRPC). Bounds: frames of at most MAX_FRAME bytes,
at most BATCH descriptors open per connection at once, `max_connections` connections, and every receive and
send waits at most `timeout_s`, so a stuck or hostile client costs one connection slot for that long."""
from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import stat
import time
from pathlib import Path

from . import local_wire
from .auth import TokenTable
from .core import ArtifactStore, FetchParams
from .errors import LimitExceeded, StoreError, Unauthenticated, Unavailable, grpc_code
from .index import index_outage

log = logging.getLogger("redknot.store")
METHODS = {"fetch": "LocalFetchShards", "report": "LocalReportCorrupt"}     # the rpcs/latency `method` label


class _Gone(Exception):
    """The peer closed the connection or stopped reading."""


class LocalFetchServer:
    def __init__(self, store: ArtifactStore, tokens: TokenTable, path: str | os.PathLike, *, mode: int = 0o600,
                 timeout_s: float = 60.0, max_connections: int = 64):
        assert mode in (0o600, 0o660), oct(mode)
        self.store, self.tokens, self.path, self.mode = store, tokens, Path(path), mode
        self.timeout_s, self.max_connections = timeout_s, max_connections
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> None:
        if self.path.is_symlink() or self.path.exists():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise SystemExit(f"local socket {self.path} exists and is not a socket")
            with local_wire.new_socket() as probe:
                try:
                    probe.connect(str(self.path))
                    raise SystemExit(f"another server listens on {self.path}")
                except ConnectionRefusedError:
                    self.path.unlink()          # left by a process that died
        # each connection holds up to BATCH descriptors at once: make room for all of them next to the rest
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = self.max_connections * local_wire.BATCH + 1024
        if soft != resource.RLIM_INFINITY and soft < need:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(hard, need),
                                                        hard))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        listener = local_wire.new_socket()
        # the file appears with the umask's mode: create it 0600, widen it only as asked (connect needs write)
        old = os.umask(0o177)
        try:
            listener.bind(str(self.path))
        except OSError as e:
            listener.close()
            raise SystemExit(f"cannot listen on local socket {self.path}: {e}") from None
        finally:
            os.umask(old)
        os.chmod(self.path, self.mode)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept())
        log.info("local socket %s (mode %o)", self.path, self.mode)

    async def close(self) -> None:
        """Stop accepting, end every connection, remove the socket file."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self.path.unlink(missing_ok=True)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            conn.setblocking(False)
            if len(self._conns) >= self.max_connections:
                try:
                    conn.send(local_wire.error_bytes(Unavailable(
                        f"local socket: {self.max_connections} connections open; retry or use gRPC")))
                except OSError:
                    pass
                conn.close()
                continue
            task = asyncio.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    raw = await asyncio.wait_for(loop.sock_recv(conn, local_wire.MAX_FRAME + 1), self.timeout_s)
                except (TimeoutError, OSError):
                    return                      # idle past the timeout, or gone
                if not raw:
                    return
                await self._request(conn, raw)
        except _Gone:
            pass
        finally:
            conn.close()

    async def _request(self, conn: socket.socket, raw: bytes) -> None:
        """One request, answered by its reply frames or one error frame; the connection stays usable."""
        started, method, code = time.perf_counter(), "LocalFetchShards", "OK"
        try:
            if len(raw) > local_wire.MAX_FRAME:
                raise LimitExceeded(f"frame of more than {local_wire.MAX_FRAME} bytes")
            req = local_wire.parse_request(raw)
            method = METHODS[req.op]
            tenant = self.tokens.tenant(req.token)
            if tenant is None:
                raise Unauthenticated("missing or unknown bearer token")
            if req.op == "fetch":
                await self._fetch(conn, tenant, req.params)
            else:
                confirmed = await self.store.confirm_corrupt(tenant, req.params)
                await self._send(conn, local_wire.pack({"confirmed": confirmed}))
        except _Gone:
            code = "CANCELLED"
            raise
        except Exception as e:                  # noqa: BLE001 - the one place this transport's errors become frames
            err = e if isinstance(e, StoreError) else index_outage(e)
            if err is None:
                log.exception("%s failed", method, exc_info=e)
                err = StoreError(f"internal error: {type(e).__name__}")
            code = grpc_code(err).name
            self._count(method, code, started)  # before the error frame: a client that sees it can scrape the count
            started = None
            await self._send(conn, local_wire.error_bytes(err))
        finally:
            if started is not None:
                self._count(method, code, started)

    def _count(self, method: str, code: str, started: float) -> None:
        self.store.metrics.rpcs.labels(method, code).inc()
        self.store.metrics.latency.labels(method).observe(time.perf_counter() - started)

    async def _fetch(self, conn: socket.socket, tenant: str, p: FetchParams) -> None:
        generation, shards = await self.store.select(tenant, p)
        # descriptors are opened (size checked) one batch at a time, so a connection holds at most BATCH; a missing
        # or truncated blob ends the answer with an error frame, as DATA_LOSS ends a FetchShards stream
        for i in range(0, max(len(shards), 1), local_wire.BATCH):
            batch = shards[i:i + local_wire.BATCH]
            files = []
            try:
                for s in batch:
                    files.append(await self.store.open_blob(tenant, p.key.doc_id, s))
                frame = local_wire.pack({"generation": generation, "shards": [s.to_list() for s in batch],
                                         "last": i + local_wire.BATCH >= len(shards)})
                # counted when handed to the socket (as gRPC counts a shard once its last chunk is handed to the
                # transport), so the counters have moved by the time the reader has the descriptors
                self.store.metrics.shards_served.labels("local").inc(len(batch))
                self.store.metrics.bytes_out.labels("local").inc(sum(s.size for s in batch))
                await self._send(conn, frame, [f.fileno() for f in files])
            finally:
                for f in files:
                    f.close()

    async def _send(self, conn: socket.socket, frame: bytes, fds: list[int] = ()) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                if fds:
                    socket.send_fds(conn, [frame], list(fds))
                else:
                    conn.send(frame)
                return
            except BlockingIOError:
                pass
            except OSError as e:
                raise _Gone(str(e)) from None
            ready = loop.create_future()
            loop.add_writer(conn.fileno(), lambda: ready.done() or ready.set_result(None))
            try:
                await asyncio.wait_for(ready, max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise _Gone(f"peer read nothing for {self.timeout_s}s") from None
            finally:
                loop.remove_writer(conn.fileno())
