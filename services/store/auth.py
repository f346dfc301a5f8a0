"""Per-tenant bearer tokens, checked in a server interceptor before any handler runs.

Tokens come from a file (one `tenant token` pair a line, `#` comments) or a `tenant=token,...` string;
only their sha256 is kept. The handler learns the tenant from `TENANT` (set by the interceptor inside the
RPC's own task), so no request field can name another tenant. Health checks and reflection need no token."""
from __future__ import annotations

import contextvars
import hashlib
from pathlib import Path

import grpc

from .errors import Unauthenticated
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


class TokenTable:
    def __init__(self, pairs: dict[str, str]):
        """`pairs`: tenant -> token."""
        self._by_hash: dict[bytes, str] = {}
        for tenant, token in pairs.items():
            check_tenant(tenant)
            if len(token) < 16:
                raise ValueError(f"token of tenant {tenant!r} is shorter than 16 characters")
            if _h(token) in self._by_hash:
                raise ValueError(f"tenants {self._by_hash[_h(token)]!r} and {tenant!r} share a token")
            self._by_hash[_h(token)] = tenant

    def __len__(self) -> int:
        return len(self._by_hash)

    def tenants(self) -> list[str]:
        return sorted(set(self._by_hash.values()))

    @staticmethod
    def parse(spec: str = "", file: str = "") -> "TokenTable":
        return TokenTable(parse_token_pairs(spec, file))

    def tenant(self, token: str) -> str | None:
        # the lookup compares sha256 digests, never the secret itself
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
