"""The API's operations, transport-agnostic: `*Params` in, pydantic views out, domain errors (errors.py) raised.
FastAPI routes (app.py) only parse, authenticate and call these; the same core could sit behind gRPC.

Invariants: every input is checked before anything is written, so a rejected request changes nothing; every
operation is scoped by the caller's tenant; an upload is acknowledged only once its build is queued (one Lua
script creates the record and enqueues the build)."""
from __future__ import annotations

import logging
import unicodedata
from dataclasses import dataclass

import redis
from pydantic import ValidationError

from services.common.registry import CorruptRecord, DocumentRecord, Registry
from services.common.serving import document_id
from services.store.client import StoreClient, fallback_reason
from services.store.errors import NotFound, StoreError
from services.store.keys import DocumentKey
from services.worker.protocol import WorkerDocument, WorkerHead, WorkerRequest, WorkerResponse

from .errors import BrokenDocument, Conflict, DocumentNotFound, InvalidInput, NotReady, PayloadTooLarge
from .metrics import REBUILD_REASONS, ApiMetrics
from .models import BrokenDocumentInfo, Document, DocumentPage, FallbackInfo, GeneratedDocument, GenerateResult, Ledger

log = logging.getLogger("redknot.api")

MAX_PAGE_TOKEN = 10**9
# Unicode categories that draw nothing: controls (NUL included), format characters (zero-width space, joiners,
# direction marks, BOM), surrogates, unassigned code points, separators; plus the fillers that are letters
# or symbols by category but blank by design
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Cn", "Zs", "Zl", "Zp"})
_BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def visible(text: str) -> bool:
    """Whether the text holds one character that draws something (stops at the first one)."""
    return any(c not in _BLANK_LETTERS and unicodedata.category(c) not in _INVISIBLE_CATEGORIES
               for c in text if not c.isspace())


@dataclass(frozen=True)
class Limits:
    max_upload_bytes: int
    max_document_tokens: int
    max_documents: int
    max_question_chars: int
    max_new_tokens: int


@dataclass(frozen=True)
class UploadParams:
    text: str | None = None
    tokens: list[int] | None = None


@dataclass(frozen=True)
class Prepared:
    records: list[DocumentRecord]       # the documents' records as read when the request was prepared
    request: WorkerRequest


@dataclass
class Timings:
    """perf_counter times of one request: arrival at the API, sent to the worker, first token, done."""
    arrived: float
    sent: float = 0.0
    first: float | None = None
    done: float = 0.0
    tokens: int = 0             # tokens the client received


@dataclass(frozen=True)
class UploadResult:
    document: Document
    queued: bool                # a build was enqueued by this call (new, rebuilt after retire/failure, or a ready
                                # document whose artifact the store can no longer serve)


class ArtifactApi:
    def __init__(self, registry: Registry, tokenizer, tokenizer_fingerprint: str, vocab_size: int,
                 store_client, limits: Limits, metrics: ApiMetrics, id_secret: bytes):
        """`store_client(tenant) -> StoreClient` (a context manager) for retiring generations; `id_secret`: the
        deployment's key of document ids (`serving.document_id`)."""
        self.registry, self.tokenizer, self.tok_fp = registry, tokenizer, tokenizer_fingerprint
        self.id_secret = id_secret
        self.vocab_size, self.store_client = vocab_size, store_client
        self.limits, self.metrics = limits, metrics

    # ------------------------------------------------------------------------------------------ documents
    def _tokens_of(self, p: UploadParams) -> tuple[list[int], str]:
        if p.text is not None:
            if len(p.text.encode("utf-8", "surrogatepass")) > self.limits.max_upload_bytes:
                raise PayloadTooLarge(f"text over {self.limits.max_upload_bytes} bytes")
            if not p.text.strip():
                raise InvalidInput("the document is empty")
            if any(0xD800 <= ord(c) <= 0xDFFF for c in p.text):
                raise InvalidInput("the text is not valid Unicode (lone surrogates)")
            if not visible(p.text):
                raise InvalidInput("the document has no visible character (only spaces, controls such as NUL, or "
                                   "format characters such as zero-width spaces)")
            return self.tokenizer.encode(p.text).ids, "text"
        if not p.tokens:
            raise InvalidInput("the document is empty")
        return list(p.tokens), "tokens"

    def upload(self, tenant: str, p: UploadParams) -> UploadResult:
        tokens, source = self._tokens_of(p)
        if not tokens:
            raise InvalidInput("the text encodes to no tokens")
        if len(tokens) > self.limits.max_document_tokens:
            raise PayloadTooLarge(f"{len(tokens)} tokens exceed the limit of {self.limits.max_document_tokens}")
        bad = sorted({t for t in tokens if not 0 <= t < self.vocab_size})
        if bad:
            raise InvalidInput(f"token ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")
        doc_id = document_id(tokens, self.tok_fp, tenant, self.id_secret)
        try:
            self.registry.get(tenant, doc_id)       # a broken record is reported before anything is written
        except CorruptRecord as e:
            raise BrokenDocument(str(e)) from None
        rec, queued = self.registry.create(tenant, doc_id, tokens, source)    # restores missing tokens too
        if not queued and rec.status == "ready":
            broken = self._broken_artifact(tenant, rec)
            if broken is not None and self._rebuild(tenant, rec, *broken, "an upload"):
                return UploadResult(self._view(self._record(tenant, doc_id)), True)
        return UploadResult(self._view(rec), queued)

    def _broken_artifact(self, tenant: str, rec: DocumentRecord) -> tuple[str, str] | None:
        """(reason, detail) when the store can no longer serve the current generation of a ready document; None when
        it can, or when that cannot be told now (store unreachable: the upload answers as before, and a request
        that meets a broken artifact still heals it).

        Checked, without any shard's bytes crossing the network: the generation's manifest is readable under the
        record's exact key (NotFound: missing_shard; an unreadable manifest: digest_mismatch); then the store's
        ValidateCertificate at that generation for every TP rank, shallow (the rank's certificate is there, the
        generation is current, every blob exists with its committed size: a stat per blob; a missing blob is
        missing_shard, a wrong size digest_mismatch), then deep (the store reads and hashes each blob where it lives:
        a flipped byte is digest_mismatch). Sizes alone miss a flipped byte and nothing cheaper is exact, the digest
        being the only witness of the content; the cost is one read of the artifact on the store, paid only by
        uploads of content that is already built and found whole by the shallow pass."""
        key = self._store_key(rec)
        with self.store_client(tenant) as client:
            try:
                client.manifest(key, rec.generation)
                # shallow first (a stat per blob: names a missing blob missing_shard), then deep (the digests)
                verdicts = ((rank, client.validate(key, rank, generation=rec.generation, deep=deep))
                            for deep in (False, True) for rank in range(key.tp_size))
                bad = next(((rank, v) for rank, v in verdicts if not v.ok), None)
            except StoreError as e:
                reason = fallback_reason(e).value
                if reason in REBUILD_REASONS:
                    return reason, f"generation {rec.generation}: {e}"
                log.warning("document %s/%s: the store could not check its artifact: %s: %s", tenant, rec.id,
                            type(e).__name__, e)
                return None
        if bad is None:
            return None
        rank, v = bad
        if v.reason is not None and v.reason.value in REBUILD_REASONS:
            return v.reason.value, f"rank {rank}: {v.detail}"
        log.warning("document %s/%s rank %d: the store says %s (%s): not rebuilt on upload", tenant, rec.id, rank,
                    v.reason.value if v.reason else "no reason", v.detail)
        return None

    def _record(self, tenant: str, doc_id: str) -> DocumentRecord:
        """The record, read whole; DocumentNotFound, or BrokenDocument when it cannot be read or shown."""
        try:
            rec = self.registry.get(tenant, doc_id)
        except CorruptRecord as e:
            raise BrokenDocument(str(e)) from None
        if rec is None:
            raise DocumentNotFound(f"no document {doc_id}")
        return rec

    def _view(self, rec: DocumentRecord) -> Document:
        try:
            return Document.of(rec)
        except ValidationError as e:
            raise BrokenDocument(f"the record of document {rec.id} does not make a document: "
                                 f"{e.error_count()} bad field(s), first {e.errors()[0]['loc']}") from None

    def _tokens(self, tenant: str, rec: DocumentRecord) -> list[int]:
        try:
            tokens = self.registry.tokens(tenant, rec.id)
        except CorruptRecord as e:
            raise BrokenDocument(f"{e}; uploading the same content again restores them") from None
        if len(tokens) != rec.n_tokens:
            raise BrokenDocument(f"document {rec.id} holds {len(tokens)} tokens, its record says {rec.n_tokens}")
        return tokens

    @staticmethod
    def _store_key(rec: DocumentRecord) -> DocumentKey:
        try:
            return DocumentKey.from_dict(rec.key)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BrokenDocument(f"the store key in the record of document {rec.id} does not parse: "
                                 f"{type(e).__name__}") from None

    def get(self, tenant: str, doc_id: str) -> Document:
        return self._view(self._record(tenant, doc_id))

    def page(self, tenant: str, page_size: int, page_token: str | None) -> DocumentPage:
        """One page; a document whose record cannot be read is named in `broken` and the others are listed."""
        token = page_token if page_token is not None else "0"
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses
        if not (token.isascii() and token.isdigit() and int(token) <= MAX_PAGE_TOKEN):
            raise InvalidInput(f"page_token {token[:24]!r} is not a token from this listing")
        ids, nxt = self.registry.page_ids(tenant, int(token), page_size)
        docs, broken = [], []
        for doc_id in ids:
            try:
                docs.append(self._view(self._record(tenant, doc_id)))
            except BrokenDocument as e:
                broken.append(BrokenDocumentInfo(id=doc_id, reason=str(e)))
            except DocumentNotFound:            # deleted between the listing and the read
                pass
        return DocumentPage(documents=docs, broken=broken, next_page_token=str(nxt) if nxt is not None else None,
                            total=self.registry.count(tenant))

    def retire(self, tenant: str, doc_id: str) -> Document:
        """Retire the current generation: the store stops serving it first, then the registry forgets it, so a
        worker that still holds it in its tier finds it stale. Retiring a retired or failed document is a no-op."""
        rec = self._record(tenant, doc_id)
        if rec.status in ("queued", "building"):
            raise Conflict(f"document {doc_id} is {rec.status}; retire it once it is ready")
        if rec.status == "ready":
            key = self._store_key(rec)
            with self.store_client(tenant) as client:
                try:
                    client.retire(key, rec.generation)
                except NotFound:        # retired before, the registry update did not happen: finish it now
                    pass
            self.registry.mark_retired(tenant, doc_id, rec.generation)
        elif rec.status == "failed":
            self.registry.mark_retired(tenant, doc_id, 0)
        return self._view(self._record(tenant, doc_id))

    # ----------------------------------------------------------------------------------------- generation
    def text_prompt(self, text: str, what: str = "the question") -> list[int]:
        """Token ids of a question or prompt given as text, checked first (the same checks on every route)."""
        if len(text) > self.limits.max_question_chars:
            raise PayloadTooLarge(f"{what} is over {self.limits.max_question_chars} characters")
        if not text.strip():
            raise InvalidInput(f"{what} is empty")
        if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
            raise InvalidInput(f"{what} is not valid Unicode (lone surrogates)")
        if not visible(text):
            raise InvalidInput(f"{what} has no visible character")
        ids = self.tokenizer.encode(text).ids
        if not ids:
            raise InvalidInput(f"{what} encodes to no tokens")
        return ids

    def token_prompt(self, tokens: list[int], what: str = "the prompt") -> list[int]:
        if not tokens:
            raise InvalidInput(f"{what} is empty")
        if len(tokens) > self.limits.max_question_chars:
            raise PayloadTooLarge(f"{what} is over {self.limits.max_question_chars} tokens")
        bad = sorted({t for t in tokens if not 0 <= t < self.vocab_size})
        if bad:
            raise InvalidInput(f"token ids {bad[:8]} in {what} are outside the vocabulary [0, {self.vocab_size})")
        return list(tokens)

    def prepare(self, tenant: str, doc_ids: list[str], prompt: list[int], max_new_tokens: int, arm: str,
                temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                ignore_eos: bool = False) -> Prepared:
        """The worker request for `prompt` (token ids, checked) after `doc_ids`: every document's record and tokens
        read and checked first (a missing or broken one is the request's error; nothing is sent)."""
        L = self.limits
        if not doc_ids:
            raise InvalidInput("name at least one document")
        if len(doc_ids) > L.max_documents:
            raise InvalidInput(f"{len(doc_ids)} documents exceed the limit of {L.max_documents}")
        if max_new_tokens > L.max_new_tokens:
            raise InvalidInput(f"max_new_tokens {max_new_tokens} exceeds the limit of {L.max_new_tokens}")
        recs = [self._record(tenant, d) for d in doc_ids]
        docs = [WorkerDocument(id=r.id, tokens=self._tokens(tenant, r), generation=r.generation) for r in recs]
        return Prepared(recs, WorkerRequest(tenant=tenant, documents=docs, question=prompt,
                                            max_new_tokens=max_new_tokens, arm=arm, temperature=temperature,
                                            top_p=top_p, seed=seed, ignore_eos=ignore_eos))

    def finished(self, tenant: str, prepared: Prepared, head: WorkerHead, t: Timings) -> None:
        """A request's latency metrics (from its arrival at the API) and, where it fell back on a broken artifact,
        its document queued for a rebuild."""
        m = self.metrics
        m.queue_seconds.labels(head.arm).observe(max(0.0, t.sent - t.arrived + head.queue_s))
        if t.first is not None:
            m.first_token_seconds.labels(head.arm).observe(t.first - t.arrived)
        m.e2e_seconds.labels(head.arm).observe(t.done - t.arrived)
        m.prompt_tokens.labels(head.arm).inc(head.prompt_tokens)
        m.cached_tokens.labels(head.arm).inc(head.cached_tokens)
        m.generation_tokens.labels(head.arm).inc(t.tokens)
        self._heal(tenant, prepared.records, head)

    def result(self, arm_requested: str, prepared: Prepared, resp: WorkerResponse) -> GenerateResult:
        return GenerateResult(
            answer=self.tokenizer.decode(resp.tokens), tokens=resp.tokens, arm_requested=arm_requested,
            arm=resp.arm, ttft_s=resp.ttft_s, fetch_s=resp.fetch_s,
            ledger=Ledger.model_validate(resp.ledger) if resp.ledger is not None else None,
            fallback=FallbackInfo.model_validate(resp.fallback.model_dump()) if resp.fallback else None,
            documents=[GeneratedDocument(id=r.id, generation=r.generation) for r in prepared.records])

    def _heal(self, tenant: str, recs: list[DocumentRecord], resp: WorkerHead) -> None:
        """A request that fell back because one document's artifact is broken (digest, missing shard or layer)
        queues that document for a rebuild under a new generation (once, however many requests meet it); until it
        is ready, requests fall back, counted, as before."""
        fb = resp.fallback
        if fb is None or fb.reason not in REBUILD_REASONS or fb.document is None:
            return
        rec = next((r for r in recs if r.id == fb.document), None)
        if rec is not None:
            self._rebuild(tenant, rec, fb.reason, fb.detail, "a request")

    def _rebuild(self, tenant: str, rec: DocumentRecord, reason: str, detail: str, met_by: str) -> bool:
        """Queue `rec`, whose current generation is broken for `reason` (one of REBUILD_REASONS), for a build under a
        new generation and count it; False when another caller queued it first (nothing changed)."""
        if not self.registry.rebuild(tenant, rec.id, rec.generation, reason):
            return False
        self.metrics.rebuilds.labels(reason).inc()
        log.warning("document %s/%s generation %d: %s (%s), met by %s: queued for a rebuild", tenant, rec.id,
                    rec.generation, reason, detail, met_by)
        return True

    # ------------------------------------------------------------------------------------------- health
    def ready(self) -> None:
        """Redis answers (the worker's readiness is the route's: its client is asynchronous)."""
        try:
            self.registry.r.ping()
        except redis.RedisError as e:
            raise NotReady(f"redis: {type(e).__name__}") from None


def store_client_factory(target: str, tenants, tls=None):
    return lambda tenant: StoreClient(target, tenants.token(tenant), timeout_s=30, tls=tls)
