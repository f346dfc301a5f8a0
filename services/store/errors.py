"""Domain errors of the artifact store and the one table that maps them to gRPC status codes.

Handlers raise these and never catch them; the server's error interceptor (grpc_service.py) turns them into
statuses with `GRPC_CODE`. A caller that sees one degrades as its docstring says; every worker-side failure
to read ends in an explicit fallback to full recomputation (SPEC §6), never in a crash."""
from __future__ import annotations

import grpc


class StoreError(Exception):
    """Base class. Unexpected: the caller reports it and, for reads, falls back to recomputation."""


class InvalidArgument(StoreError):
    """The request is malformed; nothing changed. Retrying the same request fails the same way."""


class Unauthenticated(StoreError):
    """No or unknown bearer token. The caller fixes its credentials."""


class PermissionDenied(StoreError):
    """The tenant is known but may not do this (a deployment-wide write by a tenant that is not one of the store's
    admin tenants); nothing changed. The caller uses an admin tenant's token."""


class NotFound(StoreError):
    """No such document, generation, upload or shard for this tenant (another tenant's look the same).
    A reader falls back to recomputation with reason missing_shard."""


class AlreadyExists(StoreError):
    """The generation is already committed: generations are immutable. A producer picks a new generation."""


class FailedPrecondition(StoreError):
    """The request is well-formed but the state does not allow it (e.g. commit before every declared shard
    is stored); nothing changed. The producer completes the upload and commits again."""


class LimitExceeded(StoreError):
    """A configured limit (shard size, shards per generation, chunk size) is exceeded; nothing changed."""


class DataLoss(StoreError):
    """Stored or received bytes do not match their digest. Nothing corrupt is served or committed;
    a reader falls back with reason digest_mismatch, a producer re-uploads."""


class Unavailable(StoreError):
    """The index or blob backend cannot be reached, or a blob is being collected: retry later; a reader
    falls back with reason store_unavailable."""


class DeadlineExceeded(Unavailable):
    """A stream moved no message within the store's idle bound, or outlived its deadline (settings
    `stream_idle_s`, `stream_deadline_s`); what the stream had completed stays, the shard in progress is
    discarded. Retry later, as for Unavailable."""


class NoLocalStore(Unavailable):
    """No store listens on the local socket (no socket file, or a stale one nothing accepts on): the store runs on
    another node. Raised before anything was read, so `StoreClient.fetch` takes the gRPC path instead."""


GRPC_CODE: dict[type[StoreError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    LimitExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DataLoss: grpc.StatusCode.DATA_LOSS,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    StoreError: grpc.StatusCode.INTERNAL,
}


def grpc_code(err: StoreError) -> grpc.StatusCode:
    for cls in type(err).__mro__:
        if cls in GRPC_CODE:
            return GRPC_CODE[cls]
    raise AssertionError(f"{type(err).__name__} is not a StoreError")


def error_from_status(code: grpc.StatusCode, details: str) -> StoreError:
    """The client side of the table: a status back to the domain error (unknown codes: StoreError)."""
    for cls, c in GRPC_CODE.items():
        if c == code and cls is not StoreError:
            return cls(details)
    if code is grpc.StatusCode.CANCELLED:
        return Unavailable(f"{code.name}: {details}")
    return StoreError(f"{code.name}: {details}")
