"""The loopback HTTP contract between the API and rank 0 of a worker (JSON bodies, validated here)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Arm = Literal["reuse", "recompute"]


class WorkerDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    tokens: list[int] = Field(min_length=1)
    generation: int = Field(ge=0, description="current committed generation; 0: none (not built or retired)")


class WorkerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str
    documents: list[WorkerDocument] = Field(min_length=1)
    question: list[int] = Field(min_length=1)
    max_new_tokens: int = Field(ge=1)
    arm: Arm


class Fallback(BaseModel):
    reason: str                         # a FallbackReason value: the root cause over every rank
    detail: str
    ranks: list[str | None]             # each rank's own verdict reason
    document: str | None = None         # the id of the document whose artifact the root-cause rank rejected


class WorkerResponse(BaseModel):
    tokens: list[int]
    arm: Arm                            # the arm that really ran
    ttft_s: float                       # model-forward entry (incl. certificate checks) to first token
    fetch_s: float                      # rank 0's wait for its shards before that
    ledger: dict | None                 # runtime.reuse.ledger.Ledger.summary() when the reuse arm ran
    fallback: Fallback | None
    queue_s: float = 0.0                # waiting in the worker's queue before the forward began
    decode_s: float = 0.0               # first token to last: the response left decode_s after the first token
