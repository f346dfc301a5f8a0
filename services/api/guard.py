"""The API's edge, as one ASGI layer in front of every route: each request body is read whole under the byte limit
of its route and a read deadline before any route runs, and a JSON body must be strict JSON. So a slow, huge or
malformed body is refused (408, 413, 422) before it reaches a route, and nothing it carried is echoed back.

Strict JSON: UTF-8 (no BOM, no encoded surrogates), no duplicate keys at any depth, no NaN/Infinity, no number
that overflows a float, no string holding a lone surrogate escape (\\ud800), nesting bounded. The routes then parse
the same bytes with their own models (which type-check, strictly)."""
from __future__ import annotations

import asyncio
import json
import math
import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import InvalidInput, PayloadTooLarge, RequestTimeout, error_response

MAX_JSON_DEPTH = 64
SURROGATE = re.compile("[\ud800-\udfff]")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise InvalidInput(f"duplicate key {_short(dup)} in a JSON object")
    return d


def _no_constant(name: str):
    raise InvalidInput(f"{name} is not JSON")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise InvalidInput(f"number {text[:32]} overflows")
    return x


def _short(s: str, n: int = 40) -> str:
    """A short, ASCII-safe rendering of a piece of input (never the whole of it)."""
    return json.dumps(s[:n] + ("..." if len(s) > n else ""))


def _check(v, depth: int = 0) -> None:
    if depth > MAX_JSON_DEPTH:
        raise InvalidInput(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(v, str):
        if SURROGATE.search(v):
            raise InvalidInput("a JSON string holds a lone surrogate (not valid Unicode)")
    elif isinstance(v, list):
        for x in v:
            if not isinstance(x, (int, float)):         # token ids: skip the walk over plain numbers
                _check(x, depth + 1)
    elif isinstance(v, dict):
        for k, x in v.items():
            _check(k, depth + 1)
            _check(x, depth + 1)


def strict_json(raw: bytes):
    """The value of a strict JSON document; InvalidInput naming the first problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInput(f"the JSON body is not UTF-8: {e.reason} at byte {e.start}") from None
    try:
        v = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant, parse_float=_finite)
    except json.JSONDecodeError as e:
        raise InvalidInput(f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise InvalidInput(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:                     # e.g. an integer of more digits than Python converts
        raise InvalidInput(f"malformed JSON: {str(e)[:120]}") from None
    _check(v)
    return v


def _is_json(headers: Headers) -> bool:
    ctype = headers.get("content-type", "").split(";")[0].strip().lower()
    return ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))


class BodyGuard:
    """Reads each HTTP request's body whole before the app sees it: at most `limits[(method, path)]` bytes (else
    `default_limit`), declared or streamed, within `timeout_s` from the first read; then replays it to the app.
    408 and 413 close the connection (the rest of the body is never read)."""

    def __init__(self, app: ASGIApp, limits: dict[tuple[str, str], int], default_limit: int, timeout_s: float):
        self.app, self.limits, self.default_limit, self.timeout_s = app, limits, default_limit, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.get((scope["method"], scope["path"]), self.default_limit)
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send,
                               PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {limit} bytes"))
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body, more = bytearray(), True
        while more:
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                await self._refuse(scope, receive, send, RequestTimeout(
                    f"the request body did not arrive within {self.timeout_s:g} s ({len(body)} bytes read)"))
                return
            if msg["type"] == "http.disconnect":
                return                                  # the caller left: no one to answer
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > limit:
                await self._refuse(scope, receive, send, PayloadTooLarge(f"body exceeds the limit of {limit} bytes"))
                return
        if body and _is_json(headers):
            try:
                strict_json(bytes(body))
            except InvalidInput as e:
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, _replay(bytes(body), receive), send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, exc: Exception) -> None:
        await error_response(exc, {"Connection": "close"})(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()                  # after the body: the disconnect, when it comes
    return replay
