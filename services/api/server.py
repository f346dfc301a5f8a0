"""`redknot api serve`: the app from settings, on uvicorn; SIGTERM drains and stops."""
from __future__ import annotations

import contextlib
import json
import logging
import signal

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import create_app
from .request_id import RequestIdFilter
from .settings import ApiSettings


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # SIGTERM/SIGINT: drain and exit 0 (uvicorn's own handler re-raises the signal after shutdown, so the
        # process would end "killed by SIGTERM" even when it stopped cleanly)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle_exit)
        yield


class _HeadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on the request head: a connection that has not sent a whole
    request line and headers within `head_timeout_s` of opening (or of its last response) is closed, with a 408 when
    it had started one. uvicorn closes an idle keep-alive connection, but not one that trickles its headers; the
    body's own deadline is the app's (guard.py)."""
    head_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        self._head_timer = None
        self._head_bytes = 0
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._head_bytes += len(data)
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()                      # a request is in: the app's deadlines take over

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._head_bytes = 0
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        if self._head_bytes:
            body = json.dumps({"detail": f"the request head did not arrive within {self.head_timeout_s:g} s",
                               "error": "RequestTimeout"}).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def main(s: ApiSettings) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    host, _, port = s.listen.rpartition(":")
    app = create_app(s)
    protocol = type("HeadDeadline", (_HeadDeadline,), {"head_timeout_s": s.head_timeout_s})
    print(f"redknot api: serving on {host}:{port}", flush=True)
    _Server(uvicorn.Config(app, host=host.strip("[]") or "0.0.0.0", port=int(port), log_level="warning",
                           timeout_graceful_shutdown=10, http=protocol, limit_concurrency=s.max_connections)).run()
    print("redknot api: stopped", flush=True)
    return 0
