"""`redknot eval`: multi-document QA through the same reuse engine, every arm on the same tokens, offsets,
chat template and greedy settings, with a fixed output cap.

Request layout: the chat template's text before the user content plus the instruction and document 1 form the
prefix segment; documents 2..k are relocated segments; the question and the template's tail are the new rows.
Each segment is tokenized on its own and the token lists are concatenated, identically in every arm.

Arms: recompute (the plain model), prefix-only (document 1 reused exactly, the rest recomputed), naive reuse
(every document row's K/V from its artifact, relocated, only new rows computed), and the reuse arm at each
budget (rows chosen by the rule the arm's profile names, `ReuseProfile.select`: the eval profile's is the
question's draft attention, `select=attention`, unless a variant names another rule); optional variants of the
reuse arm with other profile knobs (`arms.py`). Per arm: F1 and EM against gold
(LongBench normalization), answer agreement with the recompute arm, first-token KL(recompute || arm), the
ledger; and the near-tie-robust metrics against the recompute arm (`metrics.py`): teacher-forced top-1
agreement and mean KL per position over the recompute arm's first `teacher_tokens` continuation tokens (each
arm's own KV cache after its prefill, fed the recompute arm's tokens), answer F1 against the recompute answer,
first-span agreement. Paired bootstrap 95% CIs of the F1/EM deltas against recompute, bootstrap CIs of every
agreement metric's mean, and for each reuse arm paired CIs of its agreement metrics' deltas against naive reuse
(the arm earns its work only by beating naive reuse). A run whose reuse arm fell back on any example is
rejected."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.llama.model import Llama
from runtime.llama.tokenizer import ChatTokenizer
from runtime.llama.artifacts import produce_llama, produce_llama_packed, relocate
from runtime.reuse.greedy import greedy
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.profile import ReuseProfile
from .arms import DEFAULTS, JOIN_ROWS, RECENT_ROWS, arm_list
from .data import QAExample
from .metrics import (answer_f1, answers_agree, best_em, best_f1, bootstrap_ci, paired_bootstrap_ci, spans_agree,
                      teacher_forced)

INSTRUCTION = "Answer the question using the documents below. Reply with a short answer only.\n\n"
SPLIT = "\u0000SPLIT\u0000"


class EvalRejected(RuntimeError):
    """The reuse arm fell back on an example: the run measures nothing and is rejected."""


@dataclass
class Layout:
    segments: list[list[int]]          # prefix segment, then one per relocated document
    question: list[int]


def _chat_parts(tok: ChatTokenizer) -> tuple[str, str]:
    rendered = tok.render_chat([{"role": "user", "content": SPLIT}], add_generation_prompt=True)
    head, tail = rendered.split(SPLIT)
    return head, tail


def preamble_tokens(tok: ChatTokenizer) -> list[int]:
    """The harness's fixed preamble: the chat template's head and the instruction, the same for every example."""
    return tok.encode(_chat_parts(tok)[0] + INSTRUCTION, add_special_tokens=False)


def layout(tok: ChatTokenizer, ex: QAExample, preamble: bool = False) -> Layout:
    """The example as segments: the template's head, the instruction and document 1 as the prefix, then one
    segment per further document; with `preamble`, the head and instruction are a segment of their own (the
    preamble every document is built after, `preamble_tokens`) and every document is relocated."""
    head, tail = _chat_parts(tok)
    paras = [f"Document {i + 1}: {p}" for i, p in enumerate(ex.paragraphs)]
    if preamble:
        segs = [preamble_tokens(tok), tok.encode(paras[0], add_special_tokens=False)]
    else:
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
    tf_top1: list[float] = field(default_factory=list)       # teacher-forced top-1 agreement, mean over positions
    tf_kl: list[float] = field(default_factory=list)         # teacher-forced KL(recompute || arm), mean over positions
    answer_f1: list[float] = field(default_factory=list)     # token F1 against the recompute arm's answer
    span_agree: list[float] = field(default_factory=list)    # normalized first answer spans equal
    head_row: list[float] = field(default_factory=list)
    token_row: list[float] = field(default_factory=list)
    flop_ratio: list[float] = field(default_factory=list)
    seconds: float = 0.0


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def stop_tokens(model, tok: ChatTokenizer) -> set[int]:
    """Token ids that end a greedy answer: the model's EOS ids and the chat template's end-of-turn tokens."""
    eos = getattr(model.cfg, "eos_token_ids", None) or (model.cfg.eos_token_id,)
    return set(eos) | {t for t in (tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")) if t is not None}


def profile_summary(profile: ReuseProfile, family: str) -> dict:
    """What a summary says it measured: the base profile (its name and rule always named) and the model family."""
    return dict(profile.to_dict(), name=profile.name, select=profile.select, family=family)


def is_deepseek(model) -> bool:
    from runtime.model.deepseek_v4 import Transformer
    return isinstance(model, Transformer)


def run_eval(model, tok: ChatTokenizer, examples: list[QAExample], budgets: list[float],
             max_new_tokens: int = 32, fences: tuple[int, int] = (3, 3), progress=None,
             variants: list[str] = (), reference: bool = False, teacher_tokens: int = 32,
             profile: ReuseProfile | None = None, preamble: bool = False) -> dict:
    """Every arm on every example. The fast path (default) shares work between arms that compute the same
    thing: one packed forward of all documents for every profile's artifacts, document 1's artifact as the
    prefix-only arm's cached prefix, the relocated K/V for the naive and every reuse arm (`relocate`), each
    engine arm's prefill on its own KV cache (`prefill_cache`), and one batched greedy decode for all arms
    (`Llama.greedy_many`); an arm's `seconds` is its prefill plus an equal share of that decode. Then each arm's
    cache (greedy_many does not extend it) is fed the recompute arm's continuation in one forward for the
    teacher-forced metrics (not timed). `reference`: each arm on its own, as first written (per-segment
    attention, one decode per arm, teacher forcing a token at a time through the engine's own decode).

    A DeepSeek-V4 model runs the reuse arms of the profile it serves (`profile`, required there: its fences, rule
    and alignment; each arm's budget and knobs on top), every arm on the same padded documents, each alone as in
    `reference` (the fast path's shared relocated cache is the Llama family's); it has no naive arm."""
    assert max_new_tokens >= 1 and teacher_tokens >= 1, f"max_new_tokens={max_new_tokens} teacher={teacher_tokens}"
    stop = stop_tokens(model, tok)
    v4 = is_deepseek(model)
    if v4 and profile is None:
        raise ValueError("a DeepSeek-V4 model is evaluated under the profile it serves: pass profile=")
    if v4:
        profile.check(model.cfg)
    if profile is not None:                  # arms are named against the profile's own fences
        fences, base = (profile.first_fences, profile.last_fences), profile
    else:
        base = eval_profile(fences)
    if preamble:                            # every arm on the preamble layout; the reuse arms' documents built after it
        if v4:
            raise ValueError("a preamble is implemented on the Llama family only")
        base = base.replace(preamble=tuple(preamble_tokens(tok)))
    arms = [a for a in arm_list(budgets, list(variants), fences) if not (v4 and a.kind == "naive")]
    res = {a.name: ArmResult() for a in arms}
    engine_arms = [a for a in arms if a.kind in ("naive", "reuse")]
    for n, ex in enumerate(examples):
        lay = layout(tok, ex, preamble)
        run = _arms_deepseek if v4 else _arms_reference if reference else _arms
        answers = run(model, lay, ex, arms, engine_arms, base, res, max_new_tokens, stop, teacher_tokens)
        ref_answer, ref_first, _, ref_tf = answers["recompute"]
        ref_text = tok.decode(ref_answer).strip()
        for name, (ids, first, summ, tf) in answers.items():
            text = tok.decode(ids).strip()
            r = res[name]
            r.answers.append(text)
            r.f1.append(best_f1(text, ex.answers))
            r.em.append(best_em(text, ex.answers))
            r.agree.append(float(answers_agree(text, ref_text)))
            r.kl.append(_kl(ref_first, first))
            top1, tf_kl = teacher_forced(ref_tf, tf)
            r.tf_top1.append(top1)
            r.tf_kl.append(tf_kl)
            r.answer_f1.append(answer_f1(text, ref_text))
            r.span_agree.append(float(spans_agree(text, ref_text)))
            if summ:
                r.head_row.append(summ["head_row_saving"])
                r.token_row.append(summ["token_row_saving"])
                r.flop_ratio.append(summ["flop_ratio"])
        if progress:
            progress(n + 1, len(examples))
    summary = summarize(res, len(examples))
    summary["profile"] = profile_summary(base, "deepseek_v4" if v4 else "llama")
    summary["raw"] = {name: r.__dict__ for name, r in res.items()}
    summary["ids"] = [ex.id for ex in examples]
    return summary


def teacher_positions(ref: list[int], cap: int, window: int) -> int:
    """How many next-token positions the teacher-forced metrics cover: one per token of the recompute arm's
    continuation, plus the position that predicted its stop token when it stopped before the cap, at most
    `window`. Position 0 is the first token (the prefill's logits); position t follows ref[:t]."""
    return min(window, len(ref) + (len(ref) < cap))


def _teacher_forced_logits(model: Llama, cache, first: torch.Tensor, ref: list[int], n: int) -> torch.Tensor:
    """An arm's next-token logits [n, V] along the recompute continuation: its first-token logits, then one
    forward of ref[:n-1] on its cache (which this extends)."""
    if n == 1:
        return first[None]
    dev = next(model.parameters()).device
    rest = model(torch.tensor(ref[:n - 1], device=dev), cache, all_logits=True)
    return torch.cat([first[None], rest])


def _arms(model, lay, ex, arms, engine_arms, base, res, cap, stop, window) -> dict:
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
        eng = ReuseEngine(model, prof, mode=arm.kind)
        verdict = eng.verify(arts)
        if not verdict.ok:
            raise EvalRejected(f"example {ex.id}: {verdict.reason.value}: {verdict.detail}")
        t0 = time.perf_counter()
        r = eng.prefill_cache(arts, lay.question, reloc)
        res[arm.name].seconds += time.perf_counter() - t0
        started[arm.name] = (r.logits, r.state, r.ledger.summary())
    t0 = time.perf_counter()
    names = list(started)
    ids = model.greedy_many([started[a][1] for a in names], [started[a][0] for a in names], cap, stop)
    share = (time.perf_counter() - t0) / len(names)
    for a in names:
        res[a].seconds += share
    ref = ids[names.index("recompute")]
    n = teacher_positions(ref, cap, window)
    return {a: (i, started[a][0], started[a][2], _teacher_forced_logits(model, started[a][1], started[a][0], ref, n))
            for a, i in zip(names, ids)}


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


def _arms_reference(model, lay, ex, arms, engine_arms, base, res, max_new_tokens, stop, window) -> dict:
    answers = _baselines(model, lay, max_new_tokens, stop, window, res)
    ref = answers["recompute"][0]
    n = teacher_positions(ref, max_new_tokens, window)
    produced: dict[str, list] = {}            # arms whose profiles are equal share the artifacts
    for arm in engine_arms:
        prof = arm.profile(base)
        key = json.dumps(prof.to_dict(), sort_keys=True)
        if key not in produced:
            produced[key] = [produce_llama(model, s, prof) for s in lay.segments]
        arts = produced[key]
        eng = ReuseEngine(model, prof, mode=arm.kind)
        verdict = eng.verify(arts)
        if not verdict.ok:
            raise EvalRejected(f"example {ex.id}: {verdict.reason.value}: {verdict.detail}")
        t0 = time.perf_counter()
        ids, r = eng.generate(arts, lay.question, max_new_tokens, stop)
        res[arm.name].seconds += time.perf_counter() - t0
        answers[arm.name] = (ids, r.logits, r.ledger.summary(), _engine_forced(eng, arts, lay.question, ref, n))
    return answers


def _arms_deepseek(model, lay, ex, arms, engine_arms, base, res, max_new_tokens, stop, window) -> dict:
    """`_arms_reference` on DeepSeek-V4: every document padded to the profile's alignment with EOS (as the worker
    pads, so both arms see the same tokens), artifacts from the V4 producer, each reuse arm through the one
    engine with its profile's own rule; the ledger's FLOP ratio is its analytic one (`flop_saving["ratio"]`)."""
    from runtime.reuse.producer import pad_document, produce
    segs = [pad_document(s, base.align, model.cfg.eos_token_id) for s in lay.segments]
    padded = Layout(segs, lay.question)
    answers = _baselines(model, padded, max_new_tokens, stop, window, res)
    ref = answers["recompute"][0]
    n = teacher_positions(ref, max_new_tokens, window)
    produced: dict[str, list] = {}
    for arm in engine_arms:
        prof = arm.profile(base)
        key = json.dumps(prof.to_dict(), sort_keys=True)
        if key not in produced:
            produced[key] = [produce(model, s, prof) for s in segs]
        arts = produced[key]
        eng = ReuseEngine(model, prof)
        t0 = time.perf_counter()
        ids, r = eng.generate(arts, lay.question, max_new_tokens, stop)
        res[arm.name].seconds += time.perf_counter() - t0
        summ = r.ledger.summary()
        summ["flop_ratio"] = summ["flop_saving"]["ratio"]
        answers[arm.name] = (ids, r.logits, summ, _engine_forced(eng, arts, lay.question, ref, n))
    return answers


def _baselines(model, lay: Layout, max_new_tokens: int, stop: set[int], window: int, res) -> dict:
    """The recompute and prefix-only arms, each alone, with their teacher-forced logits along the recompute
    arm's continuation: {arm: (ids, first-token logits, None, forced logits)}."""
    tokens = [t for s in lay.segments for t in s] + lay.question
    t0 = time.perf_counter()
    out, _ = _greedy(model, tokens, max_new_tokens, stop)
    res["recompute"].seconds += time.perf_counter() - t0
    ref = out[0]
    n = teacher_positions(ref, max_new_tokens, window)
    dev = next(model.parameters()).device
    forced = torch.tensor(tokens + ref[:n - 1], device=dev)
    answers = {"recompute": out + (None, model(forced, model.new_cache(), all_logits=True)[-n:])}
    # prefix-only: document 1 exact, the rest recomputed = the recompute arm's tokens with a reused prefix
    t0 = time.perf_counter()
    answers["prefix-only"] = _prefix_only(model, lay, max_new_tokens, stop) + (None, _prefix_only_forced(model, lay,
                                                                                                           ref, n))
    res["prefix-only"].seconds += time.perf_counter() - t0
    return answers


def _prefix_only_forced(model: Llama, lay: Layout, ref: list[int], n: int) -> torch.Tensor:
    """The prefix-only arm's logits along the recompute continuation, a token at a time after its prefill."""
    dev = next(model.parameters()).device
    cache = model.new_cache()
    model.prefill(torch.tensor(lay.segments[0], device=dev), cache)
    rest = [t for s in lay.segments[1:] for t in s] + lay.question
    out = [model.prefill(torch.tensor(rest, device=dev), cache)]
    out += [model(torch.tensor([t], device=dev), cache) for t in ref[:n - 1]]
    return torch.stack(out)


def _engine_forced(eng: ReuseEngine, arts, question: list[int], ref: list[int], n: int) -> torch.Tensor:
    """An engine arm's logits along the recompute continuation: its own per-segment prefill, then its own
    decode fed the recompute tokens instead of its argmax."""
    r = eng.prefill(arts, question)
    return torch.stack([r.logits] + [eng.decode(r.state, t) for t in ref[:n - 1]])


def eval_profile(fences: tuple[int, int]) -> ReuseProfile:
    """The reuse profile every engine arm starts from: no alignment (no compression blocks on Llama), join and
    recent rows scaled to ~150-token documents, the row-selection rule and deviation signal of an arm that names
    none (`arms.DEFAULTS`). Each arm's engine runs exactly its profile's rule. The naive arm keeps this profile
    (it selects no rows)."""
    return ReuseProfile(name="eval", first_fences=fences[0], last_fences=fences[1], align=1, join_rows=JOIN_ROWS,
                        recent_rows=RECENT_ROWS, budget=0.1, select=DEFAULTS["select"], signal=DEFAULTS["signal"])


def _greedy(model: Llama, tokens: list[int], cap: int, stop: set[int]):
    dev = next(model.parameters()).device
    cache = model.new_cache()
    logits = model.prefill(torch.tensor(tokens, device=dev), cache)
    return _continue(model, cache, logits, cap, stop), cache


def _continue(model: Llama, cache, logits: torch.Tensor, cap: int, stop: set[int]):
    """Greedy decoding from the first token's logits: (new ids, first-token logits)."""
    dev = next(model.parameters()).device
    return greedy(logits, lambda t: model(torch.tensor([t], device=dev), cache), cap, stop), logits


def _prefix_only(model: Llama, lay: Layout, cap: int, stop: set[int]):
    """Document 1's K/V come from its own run (exact prefix reuse); everything after it is recomputed."""
    dev = next(model.parameters()).device
    cache = model.new_cache()
    model.prefill(torch.tensor(lay.segments[0], device=dev), cache)          # the cached prefix
    rest = [t for s in lay.segments[1:] for t in s] + lay.question
    return _continue(model, cache, model.prefill(torch.tensor(rest, device=dev), cache), cap, stop)


# summary key -> ArmResult list, for the metrics against the recompute arm
AGREEMENT = {"agreement": "agree", "first_token_kl": "kl", "tf_top1": "tf_top1", "tf_kl": "tf_kl",
             "answer_f1": "answer_f1", "span_agreement": "span_agree"}


def summarize(res: dict[str, ArmResult], n: int) -> dict:
    """Per arm the means; with more than one example, `ci` (each agreement metric's bootstrap 95% interval of the
    mean), `f1_delta`/`em_delta` against recompute, and for reuse arms `vs_naive` (each agreement metric's paired
    delta against naive reuse: [mean, low, high]; positive is better except for the KLs)."""
    ref = res["recompute"]
    naive = res.get("naive")
    out = {"n": n, "arms": {}}
    for name, r in res.items():
        row = {"f1": _mean(r.f1), "em": _mean(r.em), "seconds": r.seconds}
        row.update({k: _mean(getattr(r, a)) for k, a in AGREEMENT.items()})
        if r.head_row:
            row.update(head_row_saving=_mean(r.head_row), token_row_saving=_mean(r.token_row),
                       flop_ratio=_mean(r.flop_ratio))
        if name != "recompute" and len(r.f1) > 1:
            f1 = paired_bootstrap_ci(ref.f1, r.f1)
            em = paired_bootstrap_ci(ref.em, r.em)
            row.update(f1_delta=[f1.mean, f1.low, f1.high], em_delta=[em.mean, em.low, em.high])
        if len(r.f1) > 1:
            row["ci"] = {k: list(_interval(bootstrap_ci(getattr(r, a)))[1:]) for k, a in AGREEMENT.items()}
        if name.startswith("reuse@") and naive is not None and len(r.f1) > 1:
            row["vs_naive"] = {k: list(_interval(paired_bootstrap_ci(getattr(naive, a), getattr(r, a))))
                               for k, a in AGREEMENT.items()}
        out["arms"][name] = row
    return out


def merge_runs(summaries: list[dict]) -> dict:
    """Combine runs over disjoint chunks of a task (CPU in chunks) into one summary, CIs recomputed."""
    ids = [i for s in summaries for i in s["ids"]]
    if len(set(ids)) != len(ids):
        raise ValueError("chunks overlap: an example appears twice")
    profiles = {json.dumps(s.get("profile"), sort_keys=True) for s in summaries}
    if len(profiles) > 1:
        raise ValueError("runs of different profiles do not merge: each measures its own rule")
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
    if summaries[0].get("profile") is not None:
        out["profile"] = summaries[0]["profile"]
    out["raw"] = {name: r.__dict__ for name, r in res.items()}
    out["ids"] = ids
    return out


def _interval(ci) -> tuple[float, float, float]:
    return ci.mean, ci.low, ci.high


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else math.nan


def profile_line(p: dict) -> str:
    """Which rule and profile a table measured (the reuse arms' base profile; each arm's budget and knobs on top)."""
    return (f"Model family {p['family']}, profile `{p['name']}`: rule `select={p['select']}`, fences "
            f"{p['first_fences']}+{p['last_fences']}, FFN of non-active rows `{p['ffn_mode']}`, last fences' KV "
            f"`{p['last_fence_kv']}`, {p['global_per_group']} Global head(s) per group.")


def markdown(summary: dict, title: str) -> str:
    head = [profile_line(summary["profile"]), ""] if summary.get("profile") else []
    lines = [f"### {title} (n = {summary['n']})", "", *head,
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
    return "\n".join(lines + [""] + agreement_table(summary))


def agreement_table(summary: dict) -> list[str]:
    """Against the recompute arm, the metrics robust to near-ties, each mean with its bootstrap 95% interval;
    then each reuse arm's paired deltas against naive reuse."""
    cols = [("agreement", "exact agreement"), ("span_agreement", "first-span agreement"),
            ("answer_f1", "answer F1 vs recompute"), ("tf_top1", "teacher-forced top-1"),
            ("tf_kl", "teacher-forced KL/token"), ("first_token_kl", "first-token KL")]
    lines = ["| arm | " + " | ".join(c for _, c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, r in summary["arms"].items():
        def cell(k):
            if "ci" not in r:
                return f"{r[k]:.3f}"
            lo, hi = r["ci"][k]
            return f"{r[k]:.3f} [{lo:.3f}, {hi:.3f}]"
        lines.append(f"| {name} | " + " | ".join(cell(k) for k, _ in cols) + " |")
    deltas = [(name, r["vs_naive"]) for name, r in summary["arms"].items() if "vs_naive" in r]
    if deltas:
        lines += ["", "| reuse arm - naive [95% CI] | " + " | ".join(c for _, c in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for name, d in deltas:
            lines.append(f"| {name} | " + " | ".join(f"{d[k][0]:+.3f} [{d[k][1]:+.3f}, {d[k][2]:+.3f}]"
                                                    for k, _ in cols) + " |")
    return lines


def save(summary: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(summary, indent=1))
