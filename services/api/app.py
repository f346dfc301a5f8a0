"""FastAPI routes: thin. Each parses the body, authenticates the tenant, calls the core; errors go through one
table (errors.HTTP_STATUS), so no handler holds a try/except. `create_app` builds every object from settings.
(No `from __future__ import annotations` here: FastAPI reads the routes' annotations at run time, and the
tenant dependency is a closure inside `create_app`.)"""

import json
import time
from contextlib import asynccontextmanager
from typing import Annotated

import anyio
from fastapi import Depends, FastAPI, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.formparsers import MultiPartException, MultiPartParser

from runtime.llama.tokenizer import ChatTokenizer
from runtime.model.checkpoint import load_tokenizer
from runtime.reuse.profile import load_profile
from services.common.registry import Registry
from services.common.serving import model_config, tokenizer_fingerprint
from services.common.tenants import Tenants
from services.store.redis_client import sync_client

from .core import ArtifactApi, Limits, UploadParams, store_client_factory
from .errors import (HTTP_STATUS, InvalidInput, InvalidRequest, NotReady, PayloadTooLarge, Unauthenticated,
                     UnsupportedMediaType, error_response)
from .generation import Generations
from .guard import BodyGuard
from .metrics import ApiMetrics, ResponseCounter
from .models import DOC_ID, Document, DocumentPage, DocumentUpload, GenerateRequest, GenerateResult, Health
from .openai_api import OpenAiRoutes, register
from .request_id import RequestId, current_request_id
from .settings import ApiSettings
from .worker_client import WorkerClient

ERRORS = {code: {"description": "error", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"detail": {}}, "required": ["detail"]}}}}
    for code in (401, 404, 408, 409, 413, 415, 422, 429, 502, 503)}
ECHO_CHARS = 64         # a validation error shows at most this much of the input it refused

UPLOAD_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": DocumentUpload.model_json_schema()},
    "multipart/form-data": {"schema": {"type": "object", "additionalProperties": False, "properties": {
        "file": {"type": "string", "format": "binary", "description": "the document, UTF-8 text"},
        "text": {"type": "string"}}}},
    "text/plain": {"schema": {"type": "string"}}}}}


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes `limit` bytes, declared or streamed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes")
    return bytes(body)


def _utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInput(f"{what} is not UTF-8 text: {e.reason} at byte {e.start}") from None


class _StrictMultiPart(MultiPartParser):
    """starlette's parser, except that a text field must be UTF-8: starlette decodes an undecodable field as
    Latin-1, which would accept any bytes as some text."""

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                self.items.append((part.field_name, part.data.decode("utf-8")))
            except UnicodeDecodeError as e:
                raise MultiPartException(f"field {part.field_name[:32]!r} is not UTF-8 text: {e.reason} at byte "
                                         f"{e.start}") from None
            return
        super().on_part_end()


async def parse_upload(request: Request, limit: int) -> UploadParams:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/json":
        raw = await read_body(request, limit)       # strict JSON already (guard.py); the model checks types
        try:
            body = DocumentUpload.model_validate_json(raw)
        except ValidationError as e:        # the body is parsed here, not by FastAPI (several content types)
            raise InvalidInput(e.errors(include_url=False, include_context=False, include_input=False)) from None
        return UploadParams(text=body.text, tokens=body.tokens)
    if ctype == "text/plain":
        return UploadParams(text=_utf8(await read_body(request, limit), "the body"))
    if ctype == "multipart/form-data":
        declared = request.headers.get("content-length")
        if declared is None or not declared.isdigit() or int(declared) > limit:
            raise PayloadTooLarge(f"a multipart upload needs a Content-Length of at most {limit} bytes")
        try:
            form = await _StrictMultiPart(request.headers, request.stream(), max_files=1, max_fields=1,
                                          max_part_size=limit).parse()
        except MultiPartException as e:
            raise InvalidInput(f"malformed multipart body: {e.message}") from None
        try:
            items = form.multi_items()
            if len(items) == 1 and items[0][0] == "file" and not isinstance(items[0][1], str):
                return UploadParams(text=_utf8(await items[0][1].read(), "the file"))
            if len(items) == 1 and items[0][0] == "text" and isinstance(items[0][1], str):
                return UploadParams(text=items[0][1])
        finally:
            await form.close()
        raise InvalidInput("a multipart upload carries the document in one part: a 'file' part or a 'text' field")
    raise UnsupportedMediaType(f"content type {ctype[:64] or '(none)'!r}: use application/json, "
                               "multipart/form-data or text/plain")


def _echo(v) -> str | None:
    """What a validation error shows of the input it refused: a short, ASCII-safe rendering (a lone surrogate or
    a 50 MB body is never sent back whole)."""
    if isinstance(v, (bytes, bytearray)):
        v = bytes(v[:ECHO_CHARS]).decode("utf-8", "replace")
    elif isinstance(v, str):
        v = v[:ECHO_CHARS + 1]
    elif isinstance(v, (list, tuple)):
        v = list(v[:8])
    elif isinstance(v, dict):
        v = dict(list(v.items())[:8])
    text = json.dumps(v, ensure_ascii=True, default=lambda x: f"<{type(x).__name__}>")
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + f"... ({len(text)} chars)"


def validation_errors(errors) -> list[dict]:
    return [{"loc": [x if isinstance(x, (str, int)) else str(x) for x in e.get("loc", ())],
             "msg": str(e.get("msg", ""))[:200], "type": str(e.get("type", "")), "input": _echo(e.get("input"))}
            for e in list(errors)[:16]]


def create_app(s: ApiSettings) -> FastAPI:
    if not s.model:
        raise SystemExit("redknot api: --model (REDKNOT_MODEL) is required (tokenizer and vocabulary)")
    tenants = Tenants.load(s.tokens, s.tokens_file)
    if not len(tenants):
        raise SystemExit("redknot api: no tenants: give --tokens-file or REDKNOT_TOKENS")
    r = sync_client(s.redis_url, socket_timeout=30, socket_connect_timeout=5)
    metrics = ApiMetrics()
    worker = WorkerClient(s.worker_url, s.generate_timeout_s, tenants)
    core = ArtifactApi(Registry(r, s.redis_prefix), load_tokenizer(s.model), tokenizer_fingerprint(s.model),
                       model_config(s.model).vocab_size, store_client_factory(s.store, tenants, s.store_tls()),
                       Limits(s.max_upload_bytes, s.max_document_tokens, s.max_documents, s.max_question_chars,
                              s.max_new_tokens), metrics, s.document_id_secret())
    # the generate routes' Redis reads and bookkeeping run on threads of their own; their wait on the worker holds none
    generations = Generations(core, worker, anyio.CapacityLimiter(s.generate_concurrency))
    openai_routes = OpenAiRoutes(generations, ChatTokenizer.from_dir(s.model), s.model_name(), s.max_new_tokens,
                                 load_profile(s.profile).preamble)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await worker.aclose()
        r.close()

    # no /docs or /redoc: their pages load scripts from a CDN (blank on an air-gapped cluster); /openapi.json is the
    # document every client generator and viewer reads
    app = FastAPI(title="RedKnot-MLA artifact API", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Upload documents, follow their builds, generate with certified artifact reuse "
                              "(SPEC §6-8). Every /v1 route needs `Authorization: Bearer <tenant token>`.")
    app.state.core = core

    def domain_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc, path=request.url.path)

    def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidRequest(validation_errors(exc.errors())), path=request.url.path)

    for cls in HTTP_STATUS:
        app.add_exception_handler(cls, domain_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    # outermost first: count every response (the guard's refusals too), then read the body under its limits
    app.add_middleware(BodyGuard, limits={("POST", "/v1/documents"): s.max_upload_bytes,
                                          ("POST", "/v1/generate"): s.max_generate_bytes,
                                          ("POST", "/v1/completions"): s.max_generate_bytes,
                                          ("POST", "/v1/chat/completions"): s.max_generate_bytes},
                       default_limit=s.max_body_bytes, timeout_s=s.body_timeout_s)
    app.add_middleware(ResponseCounter, routes=app.router.routes, metrics=metrics)
    app.add_middleware(RequestId)

    bearer = HTTPBearer(auto_error=False, description="a tenant token")

    def tenant(cred: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
        who = tenants.tenant(cred.credentials) if cred is not None else None
        if who is None:
            raise Unauthenticated("missing or unknown bearer token")
        return who

    Tenant = Annotated[str, Depends(tenant)]
    DocId = Annotated[str, Path(pattern=DOC_ID, description="document id")]

    @app.post("/v1/documents", response_model=Document, status_code=202, openapi_extra=UPLOAD_BODY,
              responses={200: {"model": Document, "description": "already uploaded: nothing was queued"}, **ERRORS},
              summary="Upload a document (JSON text or tokens, multipart file, or text/plain); idempotent by "
                      "content: 202 when a build was queued, 200 when it already existed")
    async def upload(request: Request, response: Response, who: Tenant) -> Document:
        params = await parse_upload(request, s.max_upload_bytes)
        res = await run_in_threadpool(core.upload, who, params)
        response.status_code = 202 if res.queued else 200
        return res.document

    @app.get("/v1/documents", response_model=DocumentPage, responses=ERRORS, summary="List documents, oldest first")
    def list_documents(who: Tenant, page_size: Annotated[int, Query(ge=1, le=100)] = 20,
                       page_token: Annotated[str | None, Query(max_length=20)] = None) -> DocumentPage:
        return core.page(who, page_size, page_token)

    @app.get("/v1/documents/{doc_id}", response_model=Document, responses=ERRORS,
             summary="A document's build status, generations and sizes")
    def get_document(doc_id: DocId, who: Tenant) -> Document:
        return core.get(who, doc_id)

    @app.delete("/v1/documents/{doc_id}", response_model=Document, responses=ERRORS,
                summary="Retire the current generation (the store stops serving it; uploading again rebuilds)")
    def retire_document(doc_id: DocId, who: Tenant) -> Document:
        return core.retire(who, doc_id)

    @app.post("/v1/generate", response_model=GenerateResult, responses=ERRORS,
              summary="Answer a question over documents, in the reuse arm (certified artifacts, explicit "
                      "fallback) or the recompute arm (the plain model)")
    async def generate(body: GenerateRequest, who: Tenant) -> GenerateResult:
        arrived = time.perf_counter()
        question = await generations.call(core.text_prompt, body.question)
        prepared = await generations.call(core.prepare, who, body.documents, question, body.max_new_tokens, body.arm)
        resp = await generations.generate(who, prepared, arrived, current_request_id())
        return core.result(body.arm, prepared, resp)

    @app.get("/v1/calibration", responses=ERRORS,
             summary="The calibration gate on the reuse arm: the record in force and whether the reuse arm runs")
    async def calibration(who: Tenant) -> dict:
        return await worker.calibration()

    @app.get("/healthz", response_model=Health, summary="The process is up")
    async def healthz() -> Health:
        # on the event loop, no thread: answered at once however many requests are in flight (a liveness probe)
        return Health(status="ok")

    @app.get("/readyz", response_model=Health, responses=ERRORS, summary="Redis and the worker are ready")
    async def readyz() -> Health:
        await anyio.to_thread.run_sync(core.ready)
        if (why := await worker.unready()) is not None:
            raise NotReady(f"inference worker: {why}")
        return Health(status="ready")

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    register(app, openai_routes, Tenant, list(ERRORS))
    return app
