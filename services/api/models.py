"""Bodies of the HTTP API (pydantic: validated at the edge, and the OpenAPI document's schemas)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from services.common.registry import DocumentRecord

DOC_ID = r"^[0-9a-f]{32}$"
Status = Literal["queued", "building", "ready", "failed", "retired"]


class DocumentUpload(BaseModel):
    """A document as text (tokenized with the served checkpoint's tokenizer) or as token ids; exactly one.
    Strict types: a token id is a JSON integer (not true, 3.0 or "3")."""
    model_config = ConfigDict(extra="forbid", strict=True)
    text: StrictStr | None = Field(None, description="UTF-8 text")
    tokens: list[StrictInt] | None = Field(None, description="token ids of the served checkpoint's vocabulary")

    @model_validator(mode="after")
    def _one(self) -> "DocumentUpload":
        if (self.text is None) == (self.tokens is None):
            raise ValueError("give exactly one of 'text' and 'tokens'")
        return self


class Document(BaseModel):
    id: str = Field(pattern=DOC_ID, description="content hash of the token ids (the same content: the same id)")
    status: Status
    stage: str = Field(description="what the builder is doing, or the last retry's schedule")
    progress: float = Field(ge=0, le=1)
    n_tokens: int
    source: Literal["text", "tokens"]
    generation: int = Field(description="current committed generation; 0: none")
    generations: list[int] = Field(description="committed, readable generations")
    retired_generations: list[int]
    bytes: int = Field(description="stored bytes over every TP rank's shards")
    shards: int
    attempts: int = Field(description="build attempts so far")
    error: str = Field(description="last build error, empty when none")
    build_seconds: float
    created_ms: int
    updated_ms: int

    @staticmethod
    def of(r: DocumentRecord) -> "Document":
        return Document(id=r.id, status=r.status, stage=r.stage, progress=r.progress, n_tokens=r.n_tokens,
                        source=r.source, generation=r.generation, generations=r.generations,
                        retired_generations=r.retired, bytes=r.bytes, shards=r.shards, attempts=r.attempts,
                        error=r.error, build_seconds=r.build_s, created_ms=r.created_ms, updated_ms=r.updated_ms)


class BrokenDocumentInfo(BaseModel):
    id: str
    reason: str = Field(description="why its registry record cannot be read")


class DocumentPage(BaseModel):
    documents: list[Document]
    broken: list[BrokenDocumentInfo] = Field(default_factory=list, description="documents of this page whose "
                                             "registry record cannot be read (listed here instead)")
    next_page_token: str | None = Field(description="pass as page_token for the next page; null at the end")
    total: int


class GenerateRequest(BaseModel):
    """Strict types: max_new_tokens is a JSON integer (not true, 4.0 or "4")."""
    model_config = ConfigDict(extra="forbid", strict=True)
    documents: list[Annotated[StrictStr, Field(pattern=DOC_ID)]] = Field(
        min_length=1, description="document ids; the first is the prefix, the others are relocated in this order")
    question: StrictStr = Field(min_length=1)
    max_new_tokens: StrictInt = Field(16, ge=1)
    arm: Literal["reuse", "recompute"] = "reuse"


class FlopSaving(BaseModel):
    projections: float
    attention: float
    indexer: float
    moe: float
    total: float
    ratio: float | None = Field(description="recompute FLOPs / reuse FLOPs")


class Rows(BaseModel):
    prefix: int
    relocated: int
    new: int
    active: int


class Ledger(BaseModel):
    """SPEC §7's four namespaces, never mixed."""
    head_row_saving: float = Field(description="1. logical head-row saving")
    structural_ceiling: float = Field(description="its ceiling for this profile")
    token_row_saving: float = Field(description="2. physical token-row saving")
    flop_saving: FlopSaving = Field(description="3. analytic FLOP saving per major operator")
    ttft_s: dict[str, float] = Field(description="4. measured TTFT of the arm that ran")
    rows: Rows


class FallbackInfo(BaseModel):
    reason: str = Field(description="root cause over every rank (a FallbackReason value)")
    detail: str
    ranks: list[str | None] = Field(description="each TP rank's own verdict")
    document: str | None = Field(None, description="the document whose artifact failed verification, where one "
                                                   "did; a broken artifact (digest, missing shard or layer) is "
                                                   "rebuilt automatically under a new generation")


class GeneratedDocument(BaseModel):
    id: str
    generation: int


class GenerateResult(BaseModel):
    answer: str
    tokens: list[int]
    arm_requested: Literal["reuse", "recompute"]
    arm: Literal["reuse", "recompute"] = Field(description="the arm that really ran")
    ttft_s: float = Field(description="model-forward entry (certificate checks included) to first token")
    fetch_s: float = Field(description="wait for artifact shards before that")
    ledger: Ledger | None = Field(description="present when the reuse arm ran")
    fallback: FallbackInfo | None = Field(description="present when a reuse request fell back to recomputation")
    documents: list[GeneratedDocument]


class Health(BaseModel):
    status: str
