"""The demo tables' 95 % intervals against the Wilson formula's published values and float64 sampling."""
import random

import pytest

from aligner.demo.intervals import format_interval, wilson_interval


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
