"""Domain errors of the API and the one table that maps them (and the errors of what the API calls) to HTTP
statuses. Handlers and the core raise; `app.py` installs one exception handler per row of `HTTP_STATUS`."""
from __future__ import annotations

import redis
from starlette.responses import JSONResponse

from services.store import errors as store_errors

RETRY_AFTER_S = 1           # what a 503 tells the caller to wait before retrying (Retry-After)


class ApiError(Exception):
    """Base class: an unexpected failure (500)."""


class InvalidInput(ApiError):
    """The request is well-formed but its content is not acceptable (empty, out-of-vocabulary ids, not
    UTF-8); nothing changed. The caller fixes the input."""


class InvalidRequest(InvalidInput):
    """A body that does not match the route's schema (FastAPI's validation errors)."""


class PayloadTooLarge(ApiError):
    """A body or a document over a configured limit; nothing changed."""


class UnsupportedMediaType(ApiError):
    """An upload in a content type other than JSON, multipart/form-data or text/plain."""


class RequestTimeout(ApiError):
    """The request body did not arrive within the body read timeout; nothing changed, the connection is closed."""


class Unauthenticated(ApiError):
    """No bearer token, or one no tenant holds."""


class DocumentNotFound(ApiError):
    """No such document for this tenant (another tenant's documents look the same)."""


class ModelNotFound(ApiError):
    """A request for a model this deployment does not serve."""


class Conflict(ApiError):
    """The document's state does not allow this now (e.g. retire while it is still building); retry later."""


class BrokenDocument(Conflict):
    """The document's registry record or its tokens are unreadable (a deleted key, a field that does not parse).
    Only that document is affected: listing skips it (and names it), other documents serve as usual. Uploading the
    same content again restores deleted tokens; a bad record needs the operator."""


class NotReady(ApiError):
    """A dependency (Redis, the worker) is not ready; the caller retries later."""


class Busy(ApiError):
    """The worker group's queue is full: the request was not taken; the caller retries after Retry-After."""


class WorkerFailed(ApiError):
    """The worker answered with an error the API cannot pass on as the caller's fault."""


HTTP_STATUS: dict[type[Exception], int] = {
    InvalidInput: 422,
    PayloadTooLarge: 413,
    RequestTimeout: 408,
    UnsupportedMediaType: 415,
    Unauthenticated: 401,
    DocumentNotFound: 404,
    ModelNotFound: 404,
    Conflict: 409,
    NotReady: 503,
    Busy: 429,
    WorkerFailed: 502,
    store_errors.Unavailable: 503,
    redis.exceptions.ConnectionError: 503,     # Redis down or restarting (BusyLoadingError is one too)
    redis.exceptions.TimeoutError: 503,
    store_errors.StoreError: 502,
    ApiError: 500,
}


def http_status(err: Exception) -> int:
    for cls in type(err).__mro__:
        if cls in HTTP_STATUS:
            return HTTP_STATUS[cls]
    return 500


OPENAI_ROUTES = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions"})


def error_response(exc: Exception, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """The one error body: `detail` (a message, or a list of validation errors) and `error` (the class name); on
    the OpenAI-compatible routes (`path`) OpenAI's shape: `error` {message, type, param, code}, which its clients
    read. A 503 and a 429 carry Retry-After."""
    status = http_status(exc)
    detail = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], (list, dict)) else str(exc)
    if isinstance(exc, redis.RedisError):       # never pass a driver's message (host, port) to the caller
        detail = f"the registry (Redis) is unavailable: {type(exc).__name__}"
    headers = dict(headers or {})
    if status in (429, 503):
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    detail = detail or type(exc).__name__
    if path in OPENAI_ROUTES:
        message = detail if isinstance(detail, str) else "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', '')}" for e in detail)
        return JSONResponse({"error": {"message": message, "type": type(exc).__name__, "param": None,
                                       "code": status}}, status_code=status, headers=headers)
    return JSONResponse({"detail": detail, "error": type(exc).__name__}, status_code=status, headers=headers)
