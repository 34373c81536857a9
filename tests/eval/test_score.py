"""pass@k (Chen et al. 2021) against brute-force enumeration, its stability, and the per-set metrics."""
from __future__ import annotations

import itertools
from fractions import Fraction
from math import comb

import pytest

from megarl.eval.score import pass_at_k, score_set


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_correct_sample(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_stays_exact_where_binomials_overflow_a_float():
    n, c, k = 3000, 7, 200  # C(3000, 200) ~ 1e330 is past the float range
    exact = 1 - Fraction(comb(n - c, k), comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(n, 0, k) == 0.0 and pass_at_k(n, n - k + 1, k) == 1.0


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


def record(i, reward, greedy=False, tokens=3, reason="stop", error=None):
    return {"prompt_index": i, "greedy": greedy, "reward": reward, "reward_error": error, "tokens": tokens,
            "finish_reason": reason}


def test_score_set_reports_mean_reward_pass_at_k_greedy_length_and_truncation():
    records = [record(0, 1.0), record(0, 0.0), record(0, 0.0), record(0, 1.0, greedy=True),
               record(1, 0.0), record(1, 0.0, tokens=9, reason="length"), record(1, 0.0, error="ValueError: x"),
               record(1, 0.0, greedy=True)]
    m = score_set(records, k=2)
    assert m["prompts"] == 2
    assert m["reward_mean"] == pytest.approx(1 / 6)
    assert m["pass@1"] == pytest.approx((1 / 3 + 0) / 2)
    assert m["pass@2"] == pytest.approx((1 - comb(2, 2) / comb(3, 2)) / 2)  # prompt 0: 2 of 3 pairs hold its hit
    assert m["greedy"] == 0.5
    assert m["completion_len_mean"] == pytest.approx((3 * 7 + 9) / 8)
    assert m["truncated_frac"] == 1 / 8 and m["reward_errors"] == 1.0
