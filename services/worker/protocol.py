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
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63, description="the sampler's seed; none: rank 0 draws one")
    ignore_eos: bool = Field(False, description="decode max_new_tokens tokens whatever they are (benchmarks: a "
                                                "fixed output length)")
    stream: bool = Field(False, description="answer as NDJSON events: {'head': WorkerHead} when the first token "
                                            "exists, one {'token': id} per token, then {'response': WorkerResponse} "
                                            "(or {'error': ...})")


class Fallback(BaseModel):
    reason: str                         # a FallbackReason value: the root cause over every rank
    detail: str
    ranks: list[str | None]             # each rank's own verdict reason
    document: str | None = None         # the id of the document whose artifact the root-cause rank rejected


class WorkerHead(BaseModel):
    """What is known when the first token exists (a stream's first event)."""
    arm: Arm                            # the arm that really ran
    ttft_s: float                       # model-forward entry (incl. certificate checks) to first token
    fetch_s: float                      # rank 0's wait for its shards before that
    ledger: dict | None                 # runtime.reuse.ledger.Ledger.summary() when the reuse arm ran
    fallback: Fallback | None
    queue_s: float = 0.0                # waiting in the worker's queue before the forward began
    prompt_tokens: int = 0              # rows the prefill ran over: the preamble, the padded documents, the question
    cached_tokens: int = 0              # document rows taken from artifacts and not recomputed (0 when recompute ran)


class WorkerResponse(WorkerHead):
    tokens: list[int]
    decode_s: float = 0.0               # first token to last: the response left decode_s after the first token
    finish_reason: Literal["stop", "length", "cancelled"] = "length"   # eos, max_new_tokens, or the caller stopped it
