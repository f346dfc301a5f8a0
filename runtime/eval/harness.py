"""`redknot eval`: multi-document QA through the same reuse engine, every arm on the same tokens, offsets,
chat template and greedy settings, with a fixed output cap.

Request layout: the chat template's text before the user content plus the instruction and document 1 form the
prefix segment; documents 2..k are relocated segments; the question and the template's tail are the new rows.
Each segment is tokenized on its own and the token lists are concatenated, identically in every arm.

Arms: recompute (the plain model), prefix-only (document 1 reused exactly, the rest recomputed), naive reuse
(every document row's K/V from its artifact, relocated, only new rows computed), and the reuse arm at each
budget (rows chosen by the question's draft attention, `select=attention`, unless a variant names another rule); optional variants of the reuse arm with other profile knobs (`arms.py`). Per arm: F1 and EM against gold (LongBench normalization), answer agreement with the recompute arm,
first-token KL(recompute || arm), the ledger. Paired bootstrap 95% CIs of the F1/EM deltas against recompute.
A run whose reuse arm fell back on any example is rejected."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.llama.model import Llama
from runtime.llama.tokenizer import ChatTokenizer
from runtime.reuse.llama_engine import LlamaReuseEngine, produce_llama, produce_llama_packed, relocate
from runtime.reuse.profile import ReuseProfile
from .arms import JOIN_ROWS, RECENT_ROWS, arm_list
from .data import QAExample
from .metrics import answers_agree, best_em, best_f1, paired_bootstrap_ci

INSTRUCTION = "Answer the question using the documents below. Reply with a short answer only.\n\n"
SPLIT = "\u0000SPLIT\u0000"


class EvalRejected(RuntimeError):
    """The reuse arm fell back on an example: the run measures nothing and is rejected."""


@dataclass
class Layout:
    segments: list[list[int]]          # prefix segment, then one per relocated document
    question: list[int]


def layout(tok: ChatTokenizer, ex: QAExample) -> Layout:
    rendered = tok.render_chat([{"role": "user", "content": SPLIT}], add_generation_prompt=True)
    head, tail = rendered.split(SPLIT)
    paras = [f"Document {i + 1}: {p}" for i, p in enumerate(ex.paragraphs)]
    segs = [tok.encode(head + INSTRUCTION + paras[0], add_special_tokens=False)]
    segs += [tok.encode("\n\n" + p, add_special_tokens=False) for p in paras[1:]]
    q = tok.encode(f"\n\nQuestion: {ex.question}" + tail, add_special_tokens=False)
    return Layout(segs, q)


@dataclass
class ArmResult:
    answers: list[str] = field(default_factory=list)
    f1: list[float] = field(default_factory=list)
    em: list[float] = field(default_factory=list)
    agree: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    head_row: list[float] = field(default_factory=list)
    token_row: list[float] = field(default_factory=list)
    flop_ratio: list[float] = field(default_factory=list)
    seconds: float = 0.0


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def stop_tokens(model: Llama, tok: ChatTokenizer) -> set[int]:
    """Token ids that end a greedy answer: the model's EOS ids and the chat template's end-of-turn tokens."""
    return set(model.cfg.eos_token_ids) | {t for t in (tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>"))
                                           if t is not None}


def run_eval(model: Llama, tok: ChatTokenizer, examples: list[QAExample], budgets: list[float],
             max_new_tokens: int = 32, fences: tuple[int, int] = (3, 3), progress=None,
             variants: list[str] = (), reference: bool = False) -> dict:
    """Every arm on every example. The fast path (default) shares work between arms that compute the same
    thing: one packed forward of all documents for every profile's artifacts, document 1's artifact as the
    prefix-only arm's cached prefix, the relocated K/V for the naive and every reuse arm (`relocate`), each
    engine arm's prefill on its own KV cache (`prefill_cache`), and one batched greedy decode for all arms
    (`Llama.greedy_many`); an arm's `seconds` is its prefill plus an equal share of that decode.
    `reference`: each arm on its own, as first written (per-segment attention, one decode per arm)."""
    stop = stop_tokens(model, tok)
    arms = arm_list(budgets, list(variants), fences)
    res = {a.name: ArmResult() for a in arms}
    base = eval_profile(fences)
    engine_arms = [a for a in arms if a.kind in ("naive", "reuse")]
    for n, ex in enumerate(examples):
        lay = layout(tok, ex)
        if reference:
            answers = _arms_reference(model, lay, ex, arms, engine_arms, base, res, max_new_tokens, stop)
        else:
            answers = _arms(model, lay, ex, arms, engine_arms, base, res, max_new_tokens, stop)
        ref_answer, ref_first, _ = answers["recompute"]
        for name, (ids, first, summ) in answers.items():
            text = tok.decode(ids).strip()
            r = res[name]
            r.answers.append(text)
            r.f1.append(best_f1(text, ex.answers))
            r.em.append(best_em(text, ex.answers))
            r.agree.append(float(answers_agree(text, tok.decode(ref_answer).strip())))
            r.kl.append(_kl(ref_first, first))
            if summ:
                r.head_row.append(summ["head_row_saving"])
                r.token_row.append(summ["token_row_saving"])
                r.flop_ratio.append(summ["flop_ratio"])
        if progress:
            progress(n + 1, len(examples))
    summary = summarize(res, len(examples))
    summary["raw"] = {name: r.__dict__ for name, r in res.items()}
    summary["ids"] = [ex.id for ex in examples]
    return summary


def _arms(model, lay, ex, arms, engine_arms, base, res, cap, stop) -> dict:
    profs = {a.name: a.profile(base) for a in engine_arms}
    keys = list(dict.fromkeys(json.dumps(p.to_dict(), sort_keys=True) for p in profs.values()))
    key_prof = {json.dumps(p.to_dict(), sort_keys=True): p for p in profs.values()}
    # every document in one packed forward, for every profile (arms whose profiles are equal share the artifacts)
    produced = dict(zip(keys, produce_llama_packed(model, lay.segments, [key_prof[k] for k in keys])))
    started: dict[str, tuple] = {}                           # arm -> (first-token logits, cache, ledger summary)
    t0 = time.perf_counter()
    started["recompute"] = _recompute_prefill(model, lay) + (None,)
    res["recompute"].seconds += time.perf_counter() - t0
    t0 = time.perf_counter()
    doc1 = produced[keys[0]][0] if keys else produce_llama_packed(model, lay.segments[:1], [base])[0][0]
    started["prefix-only"] = _prefix_only_prefill(model, lay, doc1) + (None,)
    res["prefix-only"].seconds += time.perf_counter() - t0
    reloc = relocate(model, produced[keys[0]]) if keys else None
    for arm in engine_arms:
        prof = profs[arm.name]
        arts = produced[json.dumps(prof.to_dict(), sort_keys=True)]
        eng = LlamaReuseEngine(model, prof, mode=arm.kind, **arm.engine_kwargs())
        verdict = eng.verify(arts)
        if not verdict.ok:
            raise EvalRejected(f"example {ex.id}: {verdict.reason.value}: {verdict.detail}")
        t0 = time.perf_counter()
        first, cache, led = eng.prefill_cache(arts, lay.question, reloc)
        res[arm.name].seconds += time.perf_counter() - t0
        started[arm.name] = (first, cache, led.summary())
    t0 = time.perf_counter()
    names = list(started)
    ids = model.greedy_many([started[a][1] for a in names], [started[a][0] for a in names], cap, stop)
    share = (time.perf_counter() - t0) / len(names)
    for a in names:
        res[a].seconds += share
    return {a: (i, started[a][0], started[a][2]) for a, i in zip(names, ids)}


def _recompute_prefill(model: Llama, lay: Layout):
    dev = next(model.parameters()).device
    cache = model.new_cache()
    tokens = [t for s in lay.segments for t in s] + lay.question
    return model.prefill(torch.tensor(tokens, device=dev), cache), cache


def _prefix_only_prefill(model: Llama, lay: Layout, doc1):
    """Document 1's K/V from its own run (its artifact's K/V are exactly that), everything after it recomputed."""
    dev = next(model.parameters()).device
    cache = model.new_cache()
    for lc, k, v in zip(cache.layers, doc1.k, doc1.v):
        lc.append(k, v)
    cache.pos = doc1.n
    rest = [t for s in lay.segments[1:] for t in s] + lay.question
    return model.prefill(torch.tensor(rest, device=dev), cache), cache


def _arms_reference(model, lay, ex, arms, engine_arms, base, res, max_new_tokens, stop) -> dict:
    tokens = [t for s in lay.segments for t in s] + lay.question
    t0 = time.perf_counter()
    out, _ = _greedy(model, tokens, max_new_tokens, stop)
    res["recompute"].seconds += time.perf_counter() - t0
    answers = {"recompute": out + (None,)}
    # prefix-only: document 1 exact, the rest recomputed = the recompute arm's tokens with a reused prefix
    t0 = time.perf_counter()
    answers["prefix-only"] = _prefix_only(model, lay, max_new_tokens, stop) + (None,)
    res["prefix-only"].seconds += time.perf_counter() - t0
    produced: dict[str, list] = {}            # arms whose profiles are equal share the artifacts
    for arm in engine_arms:
        prof = arm.profile(base)
        key = json.dumps(prof.to_dict(), sort_keys=True)
        if key not in produced:
            produced[key] = [produce_llama(model, s, prof) for s in lay.segments]
        arts = produced[key]
        eng = LlamaReuseEngine(model, prof, mode=arm.kind, **arm.engine_kwargs())
        verdict = eng.verify(arts)
        if not verdict.ok:
            raise EvalRejected(f"example {ex.id}: {verdict.reason.value}: {verdict.detail}")
        t0 = time.perf_counter()
        ids, first, led = eng.generate(arts, lay.question, max_new_tokens, stop, reference=True)
        res[arm.name].seconds += time.perf_counter() - t0
        answers[arm.name] = (ids, first, led.summary())
    return answers


def eval_profile(fences: tuple[int, int]) -> ReuseProfile:
    """The reuse profile every engine arm starts from: no alignment (no compression blocks on Llama), join and
    recent rows scaled to ~150-token documents. The naive arm keeps this profile (it selects no rows)."""
    return ReuseProfile(name="eval", first_fences=fences[0], last_fences=fences[1], align=1, join_rows=JOIN_ROWS,
                        recent_rows=RECENT_ROWS, budget=0.1)


def _greedy(model: Llama, tokens: list[int], cap: int, stop: set[int]):
    dev = next(model.parameters()).device
    cache = model.new_cache()
    logits = model.prefill(torch.tensor(tokens, device=dev), cache)
    return _continue(model, cache, logits, cap, stop), cache


def _continue(model: Llama, cache, logits: torch.Tensor, cap: int, stop: set[int]):
    """Greedy decoding from the first token's logits: (new ids, first-token logits)."""
    dev = next(model.parameters()).device
    first, out = logits, []
    for _ in range(cap):
        nxt = int(logits.argmax())
        if nxt in stop:
            break
        out.append(nxt)
        logits = model(torch.tensor([nxt], device=dev), cache)
    return out, first


def _prefix_only(model: Llama, lay: Layout, cap: int, stop: set[int]):
    """Document 1's K/V come from its own run (exact prefix reuse); everything after it is recomputed."""
    dev = next(model.parameters()).device
    cache = model.new_cache()
    model.prefill(torch.tensor(lay.segments[0], device=dev), cache)          # the cached prefix
    rest = [t for s in lay.segments[1:] for t in s] + lay.question
    return _continue(model, cache, model.prefill(torch.tensor(rest, device=dev), cache), cap, stop)


def summarize(res: dict[str, ArmResult], n: int) -> dict:
    ref = res["recompute"]
    out = {"n": n, "arms": {}}
    for name, r in res.items():
        row = {"f1": _mean(r.f1), "em": _mean(r.em), "agreement": _mean(r.agree), "first_token_kl": _mean(r.kl),
               "seconds": r.seconds}
        if r.head_row:
            row.update(head_row_saving=_mean(r.head_row), token_row_saving=_mean(r.token_row),
                       flop_ratio=_mean(r.flop_ratio))
        if name != "recompute" and len(r.f1) > 1:
            f1 = paired_bootstrap_ci(ref.f1, r.f1)
            em = paired_bootstrap_ci(ref.em, r.em)
            row.update(f1_delta=[f1.mean, f1.low, f1.high], em_delta=[em.mean, em.low, em.high])
        out["arms"][name] = row
    return out


def merge_runs(summaries: list[dict]) -> dict:
    """Combine runs over disjoint chunks of a task (CPU in chunks) into one summary, CIs recomputed."""
    ids = [i for s in summaries for i in s["ids"]]
    if len(set(ids)) != len(ids):
        raise ValueError("chunks overlap: an example appears twice")
    res = {}
    for name in summaries[0]["raw"]:
        r = ArmResult()
        for s in summaries:
            for k, v in s["raw"][name].items():
                if isinstance(v, list):
                    getattr(r, k).extend(v)
                else:
                    setattr(r, k, getattr(r, k) + v)
        res[name] = r
    out = summarize(res, len(ids))
    out["raw"] = {name: r.__dict__ for name, r in res.items()}
    out["ids"] = ids
    return out


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else math.nan


def markdown(summary: dict, title: str) -> str:
    lines = [f"### {title} (n = {summary['n']})", "",
             "| arm | F1 | EM | agreement | first-token KL | F1 delta [95% CI] | EM delta [95% CI] | head-row saving | "
             "token-row saving | FLOP ratio | K3 |", "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---|"]
    for name, r in summary["arms"].items():
        def ci(k):
            return f"{r[k][0]:+.3f} [{r[k][1]:+.3f}, {r[k][2]:+.3f}]" if k in r else "—"

        def pct(k):
            return f"{r[k]:.1%}" if k in r else "—"
        lines.append(f"| {name} | {r['f1']:.3f} | {r['em']:.3f} | {r['agreement']:.3f} | {r['first_token_kl']:.3f} | "
                     f"{ci('f1_delta')} | {ci('em_delta')} | {pct('head_row_saving')} | {pct('token_row_saving')} | "
                     f"{r['flop_ratio']:.2f}x | N/A |" if "flop_ratio" in r else
                     f"| {name} | {r['f1']:.3f} | {r['em']:.3f} | {r['agreement']:.3f} | {r['first_token_kl']:.3f} | "
                     f"{ci('f1_delta')} | {ci('em_delta')} | — | — | — | N/A |")
    return "\n".join(lines)


def save(summary: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(summary, indent=1))
