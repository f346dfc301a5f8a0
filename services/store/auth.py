"""Per-tenant bearer tokens, checked in a server interceptor before any handler runs.

Tokens come from a file (one `tenant token` pair a line, `#` comments) or a `tenant=token,...` string;
only their sha256 is kept. A tokens file is followed: when it changes (mtime, size or inode; looked at, at most
once a second, on a lookup), it is read again, so tokens are added, rotated or revoked without a restart (a
Kubernetes Secret update reaches the mounted file within the kubelet's sync period). A file that no longer
parses keeps the table in force (logged). The handler learns the tenant from `TENANT` (set by the interceptor inside the
RPC's own task), so no request field can name another tenant. Health checks and reflection need no token."""
from __future__ import annotations

import contextvars
import hashlib
import logging
import os
import time
from pathlib import Path

import grpc

from .errors import InvalidArgument, Unauthenticated
from .keys import check_tenant

TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("redknot_store_tenant")
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                "/grpc.reflection.v1.ServerReflection/")


def _h(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_token_pairs(spec: str = "", file: str = "") -> dict[str, str]:
    """tenant -> token from `tenant=token,...` and/or a file of `tenant token` lines (# comments)."""
    pairs: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        tenant, sep, token = item.partition("=")
        if not sep:
            raise ValueError("tokens must be written tenant=token,tenant=token")
        pairs[tenant.strip()] = token.strip()
    if file:
        for n, line in enumerate(Path(file).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if line:
                parts = line.split()
                if len(parts) != 2:
                    raise ValueError(f"{file}:{n}: expected 'tenant token'")
                pairs[parts[0]] = parts[1]
    return pairs


log = logging.getLogger("redknot.auth")
WATCH_PERIOD_S = 1.0


class FollowsFile:
    """A table built from `tenant=token` pairs that is built again when its tokens file changes. Subclasses set
    their state in `_build(pairs)` (raising ValueError for a table they refuse) and call `_follow()` first in
    every lookup. The swap is one attribute assignment: a lookup sees the old table or the new one, whole."""

    def _watch(self, spec: str, file: str) -> None:
        self._spec, self._file = spec, file
        self._next_look = time.monotonic() + WATCH_PERIOD_S
        self._stamp = _stamp(file)

    def _build(self, pairs: dict[str, str]) -> None:
        raise NotImplementedError

    def _follow(self) -> None:
        if not getattr(self, "_file", "") or time.monotonic() < self._next_look:
            return
        self._next_look = time.monotonic() + WATCH_PERIOD_S
        stamp = _stamp(self._file)
        if stamp == self._stamp or stamp is None:
            return
        self._stamp = stamp
        try:
            self._build(parse_token_pairs(self._spec, self._file))
        except (OSError, ValueError, InvalidArgument) as e:      # unreadable, malformed, a bad tenant name
            log.error("tokens file %s changed but cannot be used (%s); the table in force is kept", self._file, e)
            return
        log.info("tokens file %s read again", self._file)


def _stamp(file: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(file)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class TokenTable(FollowsFile):
    def __init__(self, pairs: dict[str, str]):
        """`pairs`: tenant -> token."""
        self._build(pairs)

    def _build(self, pairs: dict[str, str]) -> None:
        by_hash: dict[bytes, str] = {}
        for tenant, token in pairs.items():
            check_tenant(tenant)
            if len(token) < 16:
                raise ValueError(f"token of tenant {tenant!r} is shorter than 16 characters")
            if _h(token) in by_hash:
                raise ValueError(f"tenants {by_hash[_h(token)]!r} and {tenant!r} share a token")
            by_hash[_h(token)] = tenant
        self._by_hash = by_hash

    def __len__(self) -> int:
        return len(self._by_hash)

    def tenants(self) -> list[str]:
        self._follow()
        return sorted(set(self._by_hash.values()))

    @staticmethod
    def parse(spec: str = "", file: str = "") -> "TokenTable":
        table = TokenTable(parse_token_pairs(spec, file))
        table._watch(spec, file)
        return table

    def tenant(self, token: str) -> str | None:
        # the lookup compares sha256 digests, never the secret itself
        self._follow()
        return self._by_hash.get(_h(token)) if token else None


def wrap_handler(handler: grpc.RpcMethodHandler, decorate) -> grpc.RpcMethodHandler:
    """A handler like `handler` whose behavior is `decorate(behavior, response_streams)`."""
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(decorate(handler.unary_unary, False),
                                                   handler.request_deserializer, handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(decorate(handler.unary_stream, True),
                                                    handler.request_deserializer, handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(decorate(handler.stream_unary, False),
                                                    handler.request_deserializer, handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(decorate(handler.stream_stream, True),
                                                 handler.request_deserializer, handler.response_serializer)


REFUSED = "missing or unknown bearer token"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Resolves the bearer token to a tenant. A refusal is raised as `Unauthenticated`, not aborted here, so
    the error interceptor outside it counts the call before the status reaches the client: an abort from
    here would send the status first, and a scrape right after the refused call could miss it."""

    def __init__(self, tokens: TokenTable):
        self.tokens = tokens

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        auth = dict(details.invocation_metadata or ()).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        tenant = self.tokens.tenant(token.strip()) if scheme.lower() == "bearer" else None

        def decorate(fn, streams: bool):
            if streams:
                async def stream_behavior(request, context):
                    if tenant is None:
                        raise Unauthenticated(REFUSED)
                    TENANT.set(tenant)
                    async for item in fn(request, context):
                        yield item
                return stream_behavior

            async def behavior(request, context):
                if tenant is None:
                    raise Unauthenticated(REFUSED)
                TENANT.set(tenant)
                return await fn(request, context)
            return behavior

        return wrap_handler(handler, decorate)
