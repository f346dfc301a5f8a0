"""`redknot api serve`: the app from settings, on uvicorn; SIGTERM drains and stops."""
from __future__ import annotations

import contextlib
import logging
import signal

import uvicorn

from .app import create_app
from .settings import ApiSettings


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # SIGTERM/SIGINT: drain and exit 0 (uvicorn's own handler re-raises the signal after shutdown, so the
        # process would end "killed by SIGTERM" even when it stopped cleanly)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle_exit)
        yield


def main(s: ApiSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, _, port = s.listen.rpartition(":")
    app = create_app(s)
    print(f"redknot api: serving on {host}:{port}", flush=True)
    _Server(uvicorn.Config(app, host=host.strip("[]") or "0.0.0.0", port=int(port), log_level="warning",
                           timeout_graceful_shutdown=10)).run()
    print("redknot api: stopped", flush=True)
    return 0
