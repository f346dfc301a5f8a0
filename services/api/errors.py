"""Domain errors of the API and the one table that maps them (and the errors of what the API calls) to HTTP
statuses. Handlers and the core raise; `app.py` installs one exception handler per row of `HTTP_STATUS`."""
from __future__ import annotations

from services.store import errors as store_errors


class ApiError(Exception):
    """Base class: an unexpected failure (500)."""


class InvalidInput(ApiError):
    """The request is well-formed but its content is not acceptable (empty, out-of-vocabulary ids, not
    UTF-8); nothing changed. The caller fixes the input."""


class PayloadTooLarge(ApiError):
    """A body or a document over a configured limit; nothing changed."""


class UnsupportedMediaType(ApiError):
    """An upload in a content type other than JSON, multipart/form-data or text/plain."""


class Unauthenticated(ApiError):
    """No bearer token, or one no tenant holds."""


class DocumentNotFound(ApiError):
    """No such document for this tenant (another tenant's documents look the same)."""


class Conflict(ApiError):
    """The document's state does not allow this now (e.g. retire while it is still building); retry later."""


class NotReady(ApiError):
    """A dependency (Redis, the worker) is not ready; the caller retries later."""


class WorkerFailed(ApiError):
    """The worker answered with an error the API cannot pass on as the caller's fault."""


HTTP_STATUS: dict[type[Exception], int] = {
    InvalidInput: 422,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    Unauthenticated: 401,
    DocumentNotFound: 404,
    Conflict: 409,
    NotReady: 503,
    WorkerFailed: 502,
    store_errors.Unavailable: 503,
    store_errors.StoreError: 502,
    ApiError: 500,
}


def http_status(err: Exception) -> int:
    for cls in type(err).__mro__:
        if cls in HTTP_STATUS:
            return HTTP_STATUS[cls]
    return 500
