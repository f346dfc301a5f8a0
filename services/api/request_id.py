"""Request ids: `X-Request-ID` taken from the request when it is a sane token (else a new one), returned on the
response, forwarded to the worker and written in every log line of the request (a logging filter)."""
from __future__ import annotations

import contextvars
import logging
import re
import uuid

HEADER = b"x-request-id"
_SANE = re.compile(rb"^[A-Za-z0-9._:/+=-]{1,128}$")
_current: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


def current_request_id() -> str:
    return _current.get()


class RequestId:
    """ASGI middleware (streaming-safe): the id is set before the app runs and added to the response head."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == HEADER), b"")
        rid = given.decode() if _SANE.match(given) else uuid.uuid4().hex
        token = _current.set(rid)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every record ('-' outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _current.get() or "-"
        return True
