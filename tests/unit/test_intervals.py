"""The demo tables' 95 % intervals against the Wilson formula's published values and float64 sampling; the test
of a risen fault rate against its false-alarm rate by sampling."""
import random

import pytest

from aligner.demo.intervals import format_interval, rate_rose, wilson_interval


@pytest.mark.parametrize("successes, n, low, high", [
    # Values of the Wilson score interval at z = 1.96 (Newcombe 1998, Table I, method 3 / Brown, Cai and
    # DasGupta 2001), to four places.
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0, 0.1611),
    (1, 29, 0.0061, 0.1718),
])
def test_matches_the_published_values(successes, n, low, high):
    got = wilson_interval(successes / n, n)
    assert got == pytest.approx((low, high), abs=1e-4)


def test_covers_the_true_share_about_95_percent_of_the_time():
    rng = random.Random(0)
    trials, n, true = 4000, 500, 0.6
    covered = 0
    for _ in range(trials):
        hits = sum(rng.random() < true for _ in range(n))
        low, high = wilson_interval(hits / n, n)
        covered += low <= true <= high
    assert 0.93 < covered / trials < 0.97


def test_format_and_bad_input():
    assert format_interval(0.5, 100) == "50.0 % [40.4, 59.6]"
    with pytest.raises(ValueError, match="n=0"):
        wilson_interval(0.5, 0)
    with pytest.raises(ValueError, match="not in"):
        wilson_interval(1.5, 10)


def test_rate_rose_flags_a_real_rise_and_not_a_tie_measured_twice():
    # docs/results/demo_real.md: the base's France answers 42/64 faulty, a trained model's 48/64 (no rise); the
    # base's sky answers 0/64, a model whose greedy answer echoed the question 7/64 (a rise)
    assert rate_rose(0, 64, 7, 64)
    assert not rate_rose(42, 64, 48, 64)
    assert not rate_rose(7, 64, 0, 64)  # one-sided: a fall is not a rise
    assert not rate_rose(0, 64, 0, 64) and not rate_rose(64, 64, 64, 64)
    with pytest.raises(ValueError, match="at least one sample"):
        rate_rose(0, 0, 1, 64)
    with pytest.raises(ValueError, match="not in"):
        rate_rose(65, 64, 1, 64)


def test_rate_rose_false_alarms_about_half_a_percent_and_catches_a_large_rise():
    rng = random.Random(0)

    def flagged(before: float, after: float, trials: int, n: int = 64) -> float:
        hits = 0
        for _ in range(trials):
            a = sum(rng.random() < before for _ in range(n))
            b = sum(rng.random() < after for _ in range(n))
            hits += rate_rose(a, n, b, n)
        return hits / trials

    assert flagged(0.3, 0.3, 6000) < 0.012  # nominal 0.005; the normal approximation's error at n=64 included
    assert flagged(0.1, 0.4, 500) > 0.9
