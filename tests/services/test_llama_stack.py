"""The whole CPU stack (real Redis, the store, the builder, a TP=1 worker and the API as separate processes) on a
Llama-family checkpoint: the builder certifies its artifacts into the store in the shared format, the worker
fetches, verifies and keeps them in its pinned tier and serves the reuse arm through the same engine the quality
harness measures. Both arms answer exactly what the engine and the model answer on the same tokens in this
process; the OpenAI routes and the four namespaces work as on DeepSeek-V4."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from runtime.families import load_checkpoint
from runtime.llama.artifacts import produce_llama
from runtime.model.checkpoint import load_tokenizer
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.profile import load_profile

from .conftest import running_stack, scrape, upload_built, write_tiny_llama_checkpoint

TOKEN = "acme-token-0123456789abcdef"
PROFILE = json.dumps({"name": "llama-test", "first_fences": 2, "last_fences": 2, "align": 1, "budget": 0.25,
                      "join_rows": 4, "recent_rows": 8, "select": "attention"})
TEXTS = ["The river runs past the old mill and under the stone bridge before it reaches the sea. " * 2,
         "In the morning the fishermen check their nets, the baker opens her shop, and the children walk. " * 2,
         "The lighthouse keeper wrote every storm into a book that the harbour master kept for years. " * 2]
QUESTION = "Where does the river go?"
N = 6
WAIT_S = 90.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_llama_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, checkpoint, redis_url):
    yield from running_stack(tmp_path_factory, checkpoint, redis_url, "rkllama", tp=1, profile=PROFILE,
                             tenants={"acme": TOKEN}, api_env={"REDKNOT_API_SERVED_MODEL_NAME": "tiny-llama"})


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def docs(http) -> list[str]:
    return upload_built(http, TEXTS, WAIT_S)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Both arms' greedy answers computed in this process on the tokens the API sends: the model alone, and the
    engine over artifacts produced here."""
    model, tok = load_checkpoint(checkpoint), load_tokenizer(checkpoint)
    docs = [tok.encode(t).ids for t in TEXTS]
    question = tok.encode(QUESTION).ids
    eos = model.cfg.eos_token_id

    def greedy(logits, cache):
        out = []
        while len(out) < N:
            out.append(int(logits.argmax()))
            if out[-1] == eos:
                break
            logits = model(torch.tensor(out[-1:]), cache)
        return out
    cache = model.new_cache()
    recompute = greedy(model(torch.tensor([t for d in docs for t in d] + question), cache), cache)
    prof = load_profile(PROFILE)
    r = ReuseEngine(model, prof).prefill_cache([produce_llama(model, d, prof) for d in docs], question)
    return {"recompute": recompute, "reuse": greedy(r.logits, r.state), "rows": r.ledger.summary()["rows"]}


def generate(http, ids, arm):
    r = http.post("/v1/generate", json={"documents": ids, "question": QUESTION, "max_new_tokens": N, "arm": arm})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("arm", ["recompute", "reuse"])
def test_both_arms_answer_what_the_model_and_the_engine_answer(http, docs, reference, arm):
    out = generate(http, docs, arm)
    assert out["arm"] == arm and out["fallback"] is None
    assert out["tokens"] == reference[arm]
    if arm == "reuse":
        led = out["ledger"]
        assert led["rows"] == reference["rows"] and led["rows"]["active"] > 0     # the budget recomputed rows
        assert 0 < led["head_row_saving"] <= led["structural_ceiling"] < 1
        assert led["flop_saving"]["ratio"] > 1 and led["flop_saving"]["indexer"] == 0.0
        assert set(led["flop_saving"]) >= {"projections", "attention", "moe", "total"}


def test_a_repeated_request_is_served_from_the_pinned_tier(stack, http, docs, reference):
    generate(http, docs, "reuse")
    before = scrape(stack.worker_url)
    out = generate(http, docs, "reuse")
    after = scrape(stack.worker_url)
    hit = 'redknot_cache_tier_requests_total{reason="resident",result="hit",tier="host"}'
    assert after.get(hit, 0) - before.get(hit, 0) == len(docs)
    fetched = "redknot_artifact_fetch_bytes_total"
    assert after.get(fetched, 0) == before.get(fetched, 0)            # nothing fetched again
    assert out["tokens"] == reference["reuse"] and out["arm"] == "reuse"
    assert after['redknot_tier_bytes{rank="0"}'] > 0


def test_openai_chat_with_documents_runs_the_reuse_arm(stack, docs):
    client = openai.OpenAI(base_url=stack.api_url + "/v1", api_key=TOKEN, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": [*({"type": "document", "document_id": i} for i in docs),
                                         {"type": "text", "text": QUESTION}]}]
    out = {arm: client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=4, temperature=0,
                                               extra_body={"arm": arm}) for arm in ("reuse", "recompute")}
    rk = out["reuse"].model_extra["redknot"]
    assert rk["arm"] == "reuse" and rk["fallback"] is None
    assert out["reuse"].usage.prompt_tokens_details.cached_tokens > 0
    assert out["recompute"].usage.prompt_tokens_details.cached_tokens == 0
    assert out["reuse"].usage.prompt_tokens == out["recompute"].usage.prompt_tokens
    assert scrape(stack.worker_url).get('redknot_fallbacks_total{reason="missing_shard"}', 0) == 0
