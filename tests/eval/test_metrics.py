"""LongBench answer normalization, F1 and EM on hand-computed cases; the paired bootstrap CI."""
import numpy as np
import pytest

from runtime.eval.metrics import (answers_agree, best_em, best_f1, exact_match, normalize_answer,
                                  paired_bootstrap_ci, qa_f1_score)


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
