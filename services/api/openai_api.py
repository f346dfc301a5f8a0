"""OpenAI-compatible routes over reused documents: GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
streamed as server-sent events (the first chunk once the first token exists) or answered whole.

Documents are named inside the request: a content part `{"type": "document", "document_id": ...}` in a system or
user message, or a `documents` list for completions. Each document's tokens are exactly its artifact's, and the
documents come first in the context, in the order they are named (the first is the prefix, the others are
relocated): a request is [documents][prompt], in both arms (under a profile with a preamble, the worker opens it
with the preamble, `runtime.reuse.request.served_tokens`: [preamble][documents][prompt], every document
relocated). A chat's prompt is the checkpoint's chat template (its tokenizer config) applied to the messages with
their document parts taken out; under a preamble the document parts stay where the chat names them instead (one
message, contiguous): what renders before them must be the preamble's tokens, and the prompt is what renders after
them (`_chat_prompt`), so a deployment whose preamble is its template's head and instruction serves the layout the
quality harness measured. A completion's prompt is its text, tokenized as /v1/generate tokenizes a question
(or given as token ids). `arm` ("reuse", the default, or "recompute") picks the arm; every response carries a
`redknot` object: the arm that ran, on a fallback why, and when the reuse arm ran its ledger (the four savings
namespaces). `usage.prompt_tokens_details.cached_tokens` counts the document rows (and a preamble's) taken from
certified artifacts (not recomputed); 0 when the recompute arm ran. Sampling: temperature 0 is greedy; `seed`
repeats a sampled answer.
Stop sequences end the answer (the text before the first one); the worker stops decoding when one is met.
(No `from __future__ import annotations`: FastAPI reads the routes' annotations at run time.)"""

import json
import time
from contextlib import aclosing
from typing import Annotated, Literal

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from services.worker.protocol import WorkerHead, WorkerResponse

from .core import Prepared
from .errors import InvalidInput, ModelNotFound
from .generation import Generations
from .models import DOC_ID
from .request_id import current_request_id

MAX_STOPS = 4


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class DocumentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["document"]
    document_id: StrictStr = Field(pattern=DOC_ID, description="a document id from POST /v1/documents")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[Annotated[TextPart | DocumentPart, Field(discriminator="type")]]
    name: StrictStr | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class Sampling(BaseModel):
    """The fields both routes share. Unknown fields are refused (422), so a parameter is never silently ignored."""
    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: StrictStr | list[StrictStr] | None = Field(None, description=f"up to {MAX_STOPS} stop sequences")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: StrictStr | None = None
    arm: Literal["reuse", "recompute"] = Field("reuse", description="RedKnot: the arm to run")
    ignore_eos: bool = Field(False, description="RedKnot (as vLLM's): generate max_tokens tokens even past the "
                                                "end-of-sequence token (a fixed output length, for benchmarks)")

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise InvalidInput(f"stop: at most {MAX_STOPS} non-empty sequences")
        return stops


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)


class CompletionRequest(Sampling):
    prompt: StrictStr | list[StrictInt]
    documents: list[Annotated[StrictStr, Field(pattern=DOC_ID)]] = Field(
        min_length=1, description="RedKnot: document ids; the first is the prefix, the others are relocated")
    max_tokens: StrictInt | None = Field(16, ge=1)


class TextStream:
    """The answer's text as its tokens arrive: each push gives the text that is final (held back: an incomplete
    UTF-8 character, and a tail that may be the start of a stop sequence); a stop sequence ends it (`stopped`)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0               # characters handed out
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        cut = min((i for i in (text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            return self._take(text, cut)
        end = len(text.rstrip("\ufffd"))       # a multi-byte character not complete yet
        for k in range(min(len(text), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stops):
                end = min(end, len(text) - k)
                break
        return self._take(text, end)

    def flush(self) -> str:
        return "" if self.stopped else self._take(self.tokenizer.decode(self.ids), None)

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else max(end, self.sent)
        delta, self.sent = text[self.sent:end], end
        return delta


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


# where a chat's document parts sit while it is rendered (under a preamble profile); no client text may hold it
DOCUMENTS_AT = "\x00redknot:documents\x00"


class OpenAiRoutes:
    def __init__(self, generations: Generations, chat_tokenizer, model_name: str, default_max_tokens: int,
                 preamble: tuple[int, ...] = ()):
        self.gen, self.chat, self.name = generations, chat_tokenizer, model_name
        self.core = generations.core
        self.default_max_tokens = default_max_tokens
        self.preamble = list(preamble)          # the served profile's: every request opens with it
        self.created = int(time.time())

    # ------------------------------------------------------------------------------------------ prompts
    def _chat_prompt(self, body: ChatRequest) -> tuple[list[str], list[int]]:
        """The named documents and the prompt after them. Without a preamble the documents open the context and
        the prompt is the whole rendered chat. Under a profile with a preamble (which every request opens with)
        the documents stay where the chat names them: their parts, contiguous in one message, mark a place in the
        rendered chat; what renders before it must be exactly the preamble's tokens, and the prompt is what
        renders after it: [preamble][documents][rest of the chat]."""
        docs, messages, placed = [], [], False
        for m in body.messages:
            texts = [m.content] if isinstance(m.content, str) else \
                [p.text for p in m.content if isinstance(p, TextPart)]
            if any(DOCUMENTS_AT in t for t in texts):
                raise InvalidInput("a message holds a NUL-delimited marker this API reserves")
            if isinstance(m.content, str):
                text = m.content
            else:
                named = [p.document_id for p in m.content if isinstance(p, DocumentPart)]
                if named and m.role not in ("system", "developer", "user"):
                    raise InvalidInput(f"a document part belongs in a system or user message, not {m.role}")
                docs += named
                in_place = bool(named and self.preamble)
                text = self._text(m.content, in_place, placed)
                placed = placed or in_place
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": text})
        if not self.chat.chat_template:
            raise InvalidInput("the served checkpoint has no chat template: use /v1/completions")
        if not self.preamble:
            return docs, self.core.token_prompt(self.chat.encode_chat(messages), "the rendered chat")
        if not placed:
            raise InvalidInput("this deployment opens every request with a fixed preamble and the documents after it: "
                               "name the documents in the chat where the preamble ends")
        head, tail = self.chat.render_chat(messages).split(DOCUMENTS_AT)
        got = self.chat.encode(head, add_special_tokens=False)
        if got != self.preamble:
            text = self.chat.decode(self.preamble, skip_special_tokens=False)
            raise InvalidInput(f"the chat before the documents renders to {len(got)} tokens that are not this "
                               f"deployment's preamble ({len(self.preamble)} tokens: {text[:200]!r}); every request "
                               "opens with it")
        return docs, self.core.token_prompt(self.chat.encode(tail, add_special_tokens=False), "the rendered chat")

    @staticmethod
    def _text(parts: list, in_place: bool, placed: bool) -> str:
        """A message's text parts, joined by newlines; with `in_place`, the documents' place marked between the
        parts before and after them (they must be contiguous, in one message)."""
        if not in_place:
            return "\n".join(p.text for p in parts if isinstance(p, TextPart))
        if placed:
            raise InvalidInput("name the documents in one message (they follow the preamble together)")
        kinds = [isinstance(p, DocumentPart) for p in parts]
        first, last = kinds.index(True), len(kinds) - 1 - kinds[::-1].index(True)
        if not all(kinds[first:last + 1]):
            raise InvalidInput("the document parts must be contiguous: the documents follow the preamble together")
        before = "\n".join(p.text for p in parts[:first])
        return before + DOCUMENTS_AT + "\n".join(p.text for p in parts[last + 1:])

    def _completion_prompt(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, str):
            return self.core.text_prompt(body.prompt, "the prompt")
        return self.core.token_prompt(body.prompt)

    def _check_model(self, model: str) -> None:
        if model != self.name:
            raise ModelNotFound(f"the model {model[:64]!r} does not exist: this deployment serves {self.name!r}")

    # ----------------------------------------------------------------------------------------- responses
    def _usage(self, head: WorkerHead, completion: int) -> dict:
        return {"prompt_tokens": head.prompt_tokens, "completion_tokens": completion,
                "total_tokens": head.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": head.cached_tokens}}

    @staticmethod
    def _redknot(body: Sampling, prepared: Prepared, head: WorkerHead, tokens: list[int]) -> dict:
        return {"arm_requested": body.arm, "arm": head.arm, "ttft_s": head.ttft_s, "fetch_s": head.fetch_s,
                "fallback": head.fallback.model_dump() if head.fallback is not None else None,
                "ledger": head.ledger,
                "documents": [{"id": r.id, "generation": r.generation} for r in prepared.records],
                "tokens": tokens}

    async def run(self, who: str, body: Sampling, kind: Literal["chat", "completion"], arrived: float):
        self._check_model(body.model)
        stops = body.stops()
        if kind == "chat":
            docs, prompt = await self.gen.call(self._chat_prompt, body)
            max_tokens = body.max_completion_tokens or body.max_tokens or self.default_max_tokens
        else:
            docs, prompt = body.documents, await self.gen.call(self._completion_prompt, body)
            max_tokens = body.max_tokens or self.default_max_tokens
        prepared = await self.gen.call(self.core.prepare, who, docs, prompt, max_tokens, body.arm, body.temperature,
                                       body.top_p, body.seed, body.ignore_eos)
        rid = current_request_id()
        events = self.gen.stream(who, prepared, arrived, rid)
        try:
            head = await anext(events)      # refusals (busy, not ready) are this request's HTTP error
        except BaseException:
            await events.aclose()
            raise
        ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{rid}"
        answer = Answer(self, body, kind, ident, prepared, head, TextStream(self.core.tokenizer, stops))
        if body.stream:
            return StreamingResponse(answer.sse(events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await answer.whole(events)


class Answer:
    """One response, streamed or whole, from the worker's events after the head."""

    def __init__(self, routes: OpenAiRoutes, body: Sampling, kind: str, ident: str, prepared: Prepared,
                 head: WorkerHead, text: TextStream):
        self.r, self.body, self.kind, self.id = routes, body, kind, ident
        self.prepared, self.head, self.text = prepared, head, text
        self.finish = "length"

    @property
    def tokens(self) -> list[int]:
        """The token ids received so far (the text stream keeps them)."""
        return self.text.ids

    def _frame(self, choices: list, **extra) -> dict:
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.r.created, "model": self.r.name, "choices": choices, **extra}

    async def _consume(self, events):
        """Each text delta; sets the finish reason and the tokens. Stops the worker at a stop sequence."""
        async with aclosing(events):
            async for event in events:
                if isinstance(event, WorkerResponse):
                    self.finish = "stop" if event.finish_reason == "stop" else "length"
                elif isinstance(event, int):
                    delta = self.text.push(event)
                    if delta:
                        yield delta
                    if self.text.stopped:
                        self.finish = "stop"
                        return                  # aclosing: the worker's stream closes, its decoding stops
        rest = self.text.flush()
        if rest:
            yield rest

    def _choice(self, text: str | None, finish: str | None, stream: bool) -> dict:
        c: dict = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.kind == "completion":
            c["text"] = text or ""
        elif stream:
            c["delta"] = {} if text is None else {"content": text}
        else:
            c["message"] = {"role": "assistant", "content": text}
        return c

    async def whole(self, events) -> dict:
        text = "".join([d async for d in self._consume(events)])
        return {**self._frame([self._choice(text, self.finish, False)]),
                "usage": self.r._usage(self.head, len(self.tokens)),
                "redknot": self.r._redknot(self.body, self.prepared, self.head, self.tokens)}

    async def sse(self, events):
        chunk = "chat.completion.chunk" if self.kind == "chat" else "text_completion"

        def frame(choices: list, **extra) -> bytes:
            return _sse({**self._frame(choices, **extra), "object": chunk})

        try:
            # the first chunk: the first token exists (the head came with it), whatever its text: a token's text
            # follows once it is final (a whole UTF-8 character, not the start of a stop sequence)
            if self.kind == "chat":
                yield frame([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                              "logprobs": None}])
            else:
                yield frame([self._choice("", None, True)])
            async for delta in self._consume(events):
                yield frame([self._choice(delta, None, True)])
            yield frame([self._choice(None if self.kind == "chat" else "", self.finish, True)],
                        redknot=self.r._redknot(self.body, self.prepared, self.head, self.tokens))
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield frame([], usage=self.r._usage(self.head, len(self.tokens)))
        except Exception as e:          # after the 200: the error is the stream's last event
            yield _sse({"error": {"message": str(e) or type(e).__name__, "type": type(e).__name__}})
        yield b"data: [DONE]\n\n"


ERROR = {"description": "error (OpenAI's shape)", "content": {"application/json": {"schema": {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": {},
                       "code": {"type": "integer"}}}}}}}}
STREAMED = {200: {"description": "the answer: JSON, or server-sent events with `stream: true`", "content": {
    "application/json": {"schema": {"type": "object"}}, "text/event-stream": {"schema": {"type": "string"}}}}}


def register(app, routes: OpenAiRoutes, Tenant, codes: list[int]) -> None:
    """The three routes on `app`, authenticated by the `Tenant` dependency; `codes`: their error statuses."""
    router = APIRouter()
    errors = {code: ERROR for code in codes}

    @router.get("/v1/models", responses=errors, summary="The served model (OpenAI-compatible)")
    async def models(_who: Tenant) -> dict:
        return {"object": "list", "data": [{"id": routes.name, "object": "model", "created": routes.created,
                                            "owned_by": "redknot"}]}

    @router.post("/v1/chat/completions", responses={**STREAMED, **errors},
                 summary="Chat over documents named in the messages (OpenAI-compatible; stream: server-sent events)")
    async def chat(body: ChatRequest, who: Tenant):
        return await routes.run(who, body, "chat", time.perf_counter())

    @router.post("/v1/completions", responses={**STREAMED, **errors},
                 summary="Complete a prompt after the named documents (OpenAI-compatible; stream: server-sent events)")
    async def completions(body: CompletionRequest, who: Tenant):
        return await routes.run(who, body, "completion", time.perf_counter())

    app.include_router(router)
