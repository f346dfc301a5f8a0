"""The whole CPU stack (Redis, the store, the builder, a TP=1 worker, the API as separate processes) on a tiny
Llama-family checkpoint under a profile with a preamble (a JSON profile with `"preamble": [ids]`): the builder
builds every document after the preamble (its certificate binds it), and every request, in both arms and on every
route, is [preamble][documents][prompt]: the worker opens the reuse arm with the preamble's own artifact and
relocates every named document. Both arms answer exactly what the model and the engine answer on those tokens in
this process; an artifact built under the profile without the preamble is refused by its certificate, a counted
fallback to that exact recompute answer."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from runtime.families import build, load_checkpoint
from runtime.llama.artifacts import produce_llama
from runtime.llama.tokenizer import ChatTokenizer
from runtime.model.checkpoint import load_tokenizer
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.profile import load_profile
from services.api.openai_api import DOCUMENTS_AT
from services.common.serving import Binding, checkpoint_identity
from services.store.artifact_dir import read_generation
from services.store.client import StoreClient

from .conftest import running_stack, scrape, upload_built, write_tiny_llama_checkpoint
from .test_llama_stack import N, QUESTION, TEXTS, TOKEN, WAIT_S
from .test_llama_stack import PROFILE as PLAIN

PREAMBLE = "You answer questions from the documents below, briefly."
STRAY = "The orchard behind the school grows apples, pears and a single very old walnut tree. " * 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_llama_checkpoint(tmp_path_factory)


def chat_around_documents(checkpoint) -> tuple[list[int], list[int]]:
    """The chat template rendered around a user turn [instruction][documents][question]: the token ids before the
    documents (the deployment's preamble: the template's head and the instruction) and after them."""
    chat = ChatTokenizer.from_dir(checkpoint)
    head, tail = chat.render_chat([{"role": "user", "content": PREAMBLE + DOCUMENTS_AT + QUESTION}]) \
        .split(DOCUMENTS_AT)
    return chat.encode(head, add_special_tokens=False), chat.encode(tail, add_special_tokens=False)


@pytest.fixture(scope="module")
def served(checkpoint):
    """(model, tokenizer, the preamble's ids, the preamble profile as the settings take it): the preamble is the
    chat template's head with the instruction, as the quality harness measured it."""
    model, tok = load_checkpoint(checkpoint), load_tokenizer(checkpoint)
    pre, _ = chat_around_documents(checkpoint)
    return model, tok, pre, json.dumps(dict(json.loads(PLAIN), name="llama-preamble", preamble=pre))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, checkpoint, served, redis_url):
    yield from running_stack(tmp_path_factory, checkpoint, redis_url, "rkpre", tp=1, profile=served[3],
                             tenants={"acme": TOKEN}, api_env={"REDKNOT_API_SERVED_MODEL_NAME": "tiny-llama"})


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def docs(http) -> list[str]:
    return upload_built(http, TEXTS, WAIT_S)


def greedy(model, tokens: list[int]) -> list[int]:
    """The model's own greedy answer over `tokens` (N tokens or up to its end-of-sequence token)."""
    cache, out = model.new_cache(), []
    logits = model(torch.tensor(tokens), cache)
    while len(out) < N:
        out.append(int(logits.argmax()))
        if out[-1] == model.cfg.eos_token_id:
            break
        logits = model(torch.tensor(out[-1:]), cache)
    return out


@pytest.fixture(scope="module")
def reference(served):
    """Both arms' greedy answers in this process over [preamble][documents][question]: the model alone, and the
    engine over the preamble's own artifact followed by the documents' artifacts built after it."""
    model, tok, pre, spec = served
    docs = [tok.encode(t).ids for t in TEXTS]
    question = tok.encode(QUESTION).ids
    prof = load_profile(spec)
    r = ReuseEngine(model, prof).prefill_cache([produce_llama(model, d, prof) for d in [pre] + docs], question)
    out = []
    logits = r.logits
    while len(out) < N:
        out.append(int(logits.argmax()))
        if out[-1] == model.cfg.eos_token_id:
            break
        logits = model(torch.tensor(out[-1:]), r.state)
    return {"recompute": greedy(model, pre + [t for d in docs for t in d] + question), "reuse": out,
            "rows": r.ledger.summary()["rows"], "prompt": len(pre) + sum(map(len, docs)) + len(question)}


def generate(http, ids, arm):
    r = http.post("/v1/generate", json={"documents": ids, "question": QUESTION, "max_new_tokens": N, "arm": arm})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("arm", ["recompute", "reuse"])
def test_both_arms_answer_the_model_over_preamble_documents_prompt(served, http, docs, reference, arm):
    out = generate(http, docs, arm)
    assert out["arm"] == arm and out["fallback"] is None
    assert out["tokens"] == reference[arm]
    if arm == "reuse":
        rows = out["ledger"]["rows"]
        assert rows == reference["rows"]
        # the preamble is the prefix (its own artifact), every named document is relocated
        assert rows["prefix"] == len(served[2]) and rows["relocated"] > 0 and rows["active"] > 0


def test_completions_count_the_preamble_in_usage(stack, http, docs, reference):
    out = {}
    for arm in ("reuse", "recompute"):
        r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": QUESTION, "documents": docs,
                                               "max_tokens": N, "temperature": 0, "arm": arm})
        assert r.status_code == 200, r.text
        out[arm] = r.json()
        assert out[arm]["redknot"]["arm"] == arm and out[arm]["redknot"]["fallback"] is None
        assert out[arm]["usage"]["prompt_tokens"] == reference["prompt"]     # the preamble's rows included
    rows = reference["rows"]
    # the reuse arm's rows taken from artifacts: the preamble's and the documents', less those recomputed
    assert out["reuse"]["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        rows["prefix"] + rows["relocated"] - rows["active"] > 0
    assert out["recompute"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert scrape(stack.worker_url).get('redknot_fallbacks_total{reason="missing_shard"}', 0) == 0


def test_an_artifact_built_without_the_preamble_falls_back_counted(stack, served, http, checkpoint, tmp_path):
    """A stray artifact of the profile without the preamble, filed in the store under the preamble profile's key
    before the document is uploaded (the builder then finds that generation committed and adopts it): the worker's
    certificate check refuses it (profile_mismatch) and the request answers as the recompute arm."""
    model, tok, pre, spec = served
    tokens = tok.encode(STRAY).ids
    ident = checkpoint_identity(checkpoint)
    build(model, tokens, load_profile(PLAIN), ident.fingerprint, ident.tokenizer_fingerprint, tmp_path / "a", 1)
    _, gen, shards = read_generation([tmp_path / "a"])
    key = Binding(ident, load_profile(spec), 1, model.cfg.eos_token_id).store_key(tokens)
    with StoreClient(stack.store_target, TOKEN) as client:
        client.put_generation(key, shards, gen)
    [doc] = upload_built(http, [STRAY], WAIT_S)
    before = scrape(stack.worker_url)
    out = generate(http, [doc], "reuse")
    after = scrape(stack.worker_url)
    assert out["arm"] == "recompute" and out["fallback"]["reason"] == "profile_mismatch", out["fallback"]
    assert "preamble" in out["fallback"]["detail"]
    m = 'redknot_fallbacks_total{reason="profile_mismatch"}'
    assert after.get(m, 0) - before.get(m, 0) == 1
    assert out["tokens"] == greedy(model, pre + tokens + tok.encode(QUESTION).ids)


def test_chat_names_the_documents_where_the_preamble_ends(served, stack, docs, checkpoint):
    """Under a preamble, a chat's document parts stay where the user turn names them: what renders before them is
    the preamble, what renders after them the prompt, so the request is the harness's layout [template head +
    instruction][documents][question + the template's tail], in both arms, through the unmodified openai client."""
    model, tok, pre, _ = served
    _, tail = chat_around_documents(checkpoint)
    client = openai.OpenAI(base_url=stack.api_url + "/v1", api_key=TOKEN, max_retries=0, timeout=120)
    parts = [{"type": "text", "text": PREAMBLE}, *({"type": "document", "document_id": i} for i in docs),
             {"type": "text", "text": QUESTION}]
    want = greedy(model, pre + [t for x in TEXTS for t in tok.encode(x).ids] + tail)
    prompt = len(pre) + sum(len(tok.encode(x).ids) for x in TEXTS) + len(tail)
    out = {arm: client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": parts}],
                                               max_tokens=N, temperature=0, extra_body={"arm": arm})
           for arm in ("recompute", "reuse")}
    for arm, o in out.items():
        rk = o.model_extra["redknot"]
        assert rk["arm"] == arm and rk["fallback"] is None
        assert o.usage.prompt_tokens == prompt
    assert out["recompute"].model_extra["redknot"]["tokens"] == want
    rows = out["reuse"].model_extra["redknot"]["ledger"]["rows"]
    assert rows["prefix"] == len(pre) and out["reuse"].usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("content, why", [
    (lambda d: [{"type": "text", "text": "Something else."}, *d, {"type": "text", "text": QUESTION}],
     "not this deployment's preamble"),
    (lambda d: [{"type": "text", "text": PREAMBLE}, d[0], {"type": "text", "text": "and"}, *d[1:]],
     "contiguous"),
    (lambda d: [{"type": "text", "text": PREAMBLE + QUESTION}], "name the documents"),
    (lambda d: [{"type": "text", "text": PREAMBLE + DOCUMENTS_AT}, *d], "reserves"),
])
def test_a_chat_that_does_not_open_with_the_preamble_is_refused(http, docs, content, why):
    parts = [{"type": "document", "document_id": i} for i in docs]
    r = http.post("/v1/chat/completions", json={"model": "tiny-llama", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": content(parts)}]})
    assert r.status_code == 422 and why in r.text, r.text
