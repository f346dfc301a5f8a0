"""Answer metrics with LongBench's semantics, metrics of an arm against the recompute arm that are robust to
near-ties, and bootstrap confidence intervals (of a mean, and of the per-example difference of two arms).

LongBench (metrics.py, English QA): normalize = lower-case, drop ASCII punctuation, drop the articles
a/an/the, collapse whitespace; qa_f1_score = token-level F1 of the normalized strings, 0 when no token is
shared (also when either side is empty); an example scores the best over its gold answers. LongBench has
no EM for these tasks; ours is equality of the normalized strings, best over gold answers.

Against the recompute arm, beside exact answer agreement (one flipped near-tie early in the answer changes
every later token, so exact agreement undercounts arms that answer the same thing):
- teacher-forced agreement: the recompute arm's greedy continuation is fed to both arms; at each of the first
  positions, whether the two arms' top-1 tokens agree and KL(recompute || arm) of the next-token distributions
  (`teacher_forced`), each averaged over the positions;
- answer F1: LongBench's token F1 of the arm's answer against the recompute arm's answer (1 when both are
  empty: the same non-answer);
- first-span agreement: equality of the normalized first answer spans (`first_span`: the text before the
  first line break or sentence end), so "Paris." and "Paris. It is the capital of France" agree.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def exact_match(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def best_f1(prediction: str, answers: Sequence[str]) -> float:
    return max((qa_f1_score(prediction, a) for a in answers), default=0.0)


def best_em(prediction: str, answers: Sequence[str]) -> float:
    return max((exact_match(prediction, a) for a in answers), default=0.0)


def answers_agree(a: str, b: str) -> bool:
    """Two arms gave the same answer: equal after LongBench normalization."""
    return normalize_answer(a) == normalize_answer(b)


_SPAN_END = re.compile(r"\n|(?<=[.!?;])\s")


def first_span(s: str) -> str:
    """The answer's first span: up to the first line break or the first ". ", "! ", "? ", "; " (a period
    inside a number, 3.5, does not end it), stripped."""
    return _SPAN_END.split(s.strip(), maxsplit=1)[0].strip()


def answer_f1(prediction: str, reference: str) -> float:
    """Token F1 of `prediction` against the `reference` arm's answer; 1 when both normalize to nothing."""
    p, r = normalize_answer(prediction).split(), normalize_answer(reference).split()
    return 1.0 if not p and not r else token_f1(p, r)


def spans_agree(a: str, b: str) -> bool:
    return normalize_answer(first_span(a)) == normalize_answer(first_span(b))


def teacher_forced(reference: torch.Tensor, arm: torch.Tensor) -> tuple[float, float]:
    """Next-token logits [P, V] of the reference arm and of an arm at the same P positions of one teacher-forced
    continuation -> (fraction of positions whose top-1 tokens agree, mean over positions of
    KL(reference || arm) in nats)."""
    assert reference.shape == arm.shape and reference.ndim == 2 and reference.shape[0] > 0, \
        f"logits {tuple(reference.shape)} vs {tuple(arm.shape)}"
    lp, lq = torch.log_softmax(reference.float(), -1), torch.log_softmax(arm.float(), -1)
    top1 = (reference.argmax(-1) == arm.argmax(-1)).float().mean()
    kl = (lp.exp() * (lp - lq)).sum(-1).mean()
    return float(top1), float(kl)


@dataclass(frozen=True)
class DeltaCI:
    """Mean of treatment - baseline over n paired examples and its percentile bootstrap interval."""
    mean: float
    low: float
    high: float
    n: int
    confidence: float
    resamples: int
    seed: int

    def __str__(self) -> str:
        return f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}]"


def paired_bootstrap_ci(baseline: Sequence[float], treatment: Sequence[float], resamples: int = 10000,
                        confidence: float = 0.95, seed: int = 0, chunk: int = 1000) -> DeltaCI:
    """Resample example indices with replacement (the same indices for both arms, so the pairing is kept),
    take the mean delta of each resample, and report the (1-c)/2 and (1+c)/2 percentiles."""
    base = np.asarray(baseline, dtype=np.float64)
    treat = np.asarray(treatment, dtype=np.float64)
    assert base.shape == treat.shape and base.ndim == 1, f"unpaired shapes {base.shape} vs {treat.shape}"
    assert base.size > 0, "no examples"
    assert 0 < confidence < 1, f"confidence={confidence}"
    delta = treat - base
    n = delta.size
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for a in range(0, resamples, chunk):
        b = min(a + chunk, resamples)
        means[a:b] = delta[rng.integers(0, n, size=(b - a, n))].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return DeltaCI(float(delta.mean()), float(low), float(high), n, confidence, resamples, seed)


def bootstrap_ci(values: Sequence[float], resamples: int = 10000, confidence: float = 0.95,
                 seed: int = 0) -> DeltaCI:
    """The percentile bootstrap interval of a mean (the paired interval against a baseline of zeros)."""
    return paired_bootstrap_ci(np.zeros(len(values)), values, resamples, confidence, seed)
