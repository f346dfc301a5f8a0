"""LongBench answer normalization, F1 and EM on hand-computed cases; the near-tie metrics against the recompute
arm on hand-computed logits; the bootstrap CIs."""
import math

import numpy as np
import pytest
import torch

from runtime.eval.metrics import (answer_f1, answers_agree, best_em, best_f1, bootstrap_ci, exact_match, first_span,
                                  normalize_answer, paired_bootstrap_ci, qa_f1_score, spans_agree, teacher_forced)


def test_normalize_like_longbench():
    assert normalize_answer("The  Cat's hat!") == "cats hat"
    assert normalize_answer("An apple, a pear and THE end.") == "apple pear and end"
    assert normalize_answer("theory of an-other") == "theory of another"        # articles only as words
    assert normalize_answer("  \n\t ") == ""
    assert normalize_answer("café—naïve") == "café—naïve"                       # only ASCII punctuation goes


def test_f1_and_em():
    assert qa_f1_score("Paris", "paris.") == 1.0
    assert qa_f1_score("Paris, France", "Paris") == pytest.approx(2 / 3)       # P=1/2, R=1
    assert qa_f1_score("the the", "the") == 0.0                                 # nothing left after articles
    assert qa_f1_score("", "Paris") == 0.0 and qa_f1_score("", "") == 0.0      # LongBench: 0 when nothing shared
    assert qa_f1_score("x b b c", "b b d") == pytest.approx(2 * (2 / 4) * (2 / 3) / (2 / 4 + 2 / 3))
    assert qa_f1_score("a b b c", "b b d") == pytest.approx(2 / 3)                 # "a" is an article: P=R=2/3
    assert exact_match("The Beatles!", "beatles") == 1.0 and exact_match("Beatles band", "beatles") == 0.0
    assert best_f1("Denver Broncos", ["Broncos", "Denver Broncos", "Carolina"]) == 1.0
    assert best_em("Broncos.", ["Denver Broncos", "the Broncos"]) == 1.0
    assert best_f1("x", []) == 0.0
    assert answers_agree("The Eiffel Tower.", "eiffel tower") and not answers_agree("yes", "no")


def test_bootstrap_ci_basic_properties():
    rng = np.random.default_rng(1)
    base = rng.random(400)
    same = paired_bootstrap_ci(base, base)
    assert (same.mean, same.low, same.high) == (0.0, 0.0, 0.0)
    shifted = paired_bootstrap_ci(base, base - 0.25)
    assert shifted.low == pytest.approx(-0.25) and shifted.high == pytest.approx(-0.25)
    # deterministic for a seed, different across seeds
    treat = base + rng.normal(0.05, 0.3, 400)
    a, b = paired_bootstrap_ci(base, treat, seed=3), paired_bootstrap_ci(base, treat, seed=3)
    assert a == b and paired_bootstrap_ci(base, treat, seed=4) != a
    assert a.low < a.mean < a.high and a.n == 400 and a.confidence == 0.95


def test_bootstrap_ci_matches_normal_theory():
    """For a mean of 2000 paired deltas the bootstrap interval is close to mean +- 1.96 sd / sqrt(n)."""
    rng = np.random.default_rng(2)
    base = rng.random(2000)
    treat = base + rng.normal(-0.02, 0.2, 2000)
    ci = paired_bootstrap_ci(base, treat, resamples=4000)
    d = treat - base
    half = 1.96 * d.std(ddof=1) / np.sqrt(d.size)
    assert ci.low == pytest.approx(d.mean() - half, abs=0.15 * half)
    assert ci.high == pytest.approx(d.mean() + half, abs=0.15 * half)


def test_bootstrap_refuses_unpaired():
    with pytest.raises(AssertionError, match="unpaired"):
        paired_bootstrap_ci([1.0, 0.0], [1.0])


def test_first_span_and_its_agreement():
    assert first_span("Paris. It is the capital.") == "Paris" + "."
    assert first_span("3.5 kg\nmore text") == "3.5 kg"                           # a decimal point ends nothing
    assert first_span("  yes!  No.") == "yes!" and first_span("") == ""
    assert spans_agree("Paris.", "paris. The capital of France is Paris.")
    assert not spans_agree("Paris", "Lyon. Paris")


def test_answer_f1_against_the_recompute_answer():
    assert answer_f1("Paris, France", "Paris") == pytest.approx(2 / 3)
    assert answer_f1("", "") == 1.0 and answer_f1("the", "") == 1.0              # the same non-answer
    assert answer_f1("", "Paris") == 0.0


def test_teacher_forced_on_hand_computed_logits():
    """Position 0: reference p = (1/4, 3/4), arm q = (2/3, 1/3): top-1 differ, KL = 1/4 ln(3/8) + 3/4 ln(9/4).
    Position 1: equal logits: top-1 agree, KL 0. Means over the two positions."""
    ln = math.log
    ref = torch.tensor([[0.0, ln(3)], [ln(3), 0.0]])
    arm = torch.tensor([[ln(2), 0.0], [ln(3), 0.0]])
    top1, kl = teacher_forced(ref, arm)
    assert top1 == 0.5
    assert kl == pytest.approx((0.25 * ln(3 / 8) + 0.75 * ln(9 / 4)) / 2, abs=1e-6)
    assert teacher_forced(ref, ref) == (1.0, 0.0)
    # a shift of all logits of a position changes nothing
    assert teacher_forced(ref, arm + torch.tensor([[5.0], [-2.0]])) == pytest.approx((top1, kl), abs=1e-6)
    with pytest.raises(AssertionError, match="logits"):
        teacher_forced(ref, arm[:1])


def test_bootstrap_ci_of_a_mean():
    assert _triple(bootstrap_ci([0.5] * 7)) == (0.5, 0.5, 0.5)
    v = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    ci = bootstrap_ci(v, seed=5)
    assert ci.mean == 0.75 and 0.0 <= ci.low < 0.75 < ci.high <= 1.0
    assert ci == paired_bootstrap_ci([0.0] * len(v), v, seed=5)


def _triple(ci):
    return ci.mean, ci.low, ci.high
