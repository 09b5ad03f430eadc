"""How sure a demo table's row is: the 95 % interval of a share measured on n held-out problems; and whether a
share rose (`rate_rose`: a trained model's sampled answers with a fault, against the base's).

The Wilson score interval and the two-proportion z-test (written out here: each is a few lines, and the project's
dependencies carry no statistics library). Unlike the normal approximation the interval stays inside [0, 1] and
does not collapse to a point at 0 % or 100 %, which demo rows reach (the random init scores 0 %).
"""
from __future__ import annotations

import math

Z_95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def wilson_interval(share: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """The interval (low, high) for `share` = successes / n."""
    if n <= 0:
        raise ValueError(f"an interval needs at least one problem, got n={n}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share {share} is not in [0, 1]")
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def format_interval(share: float, n: int) -> str:
    """'60.4 % [56.1, 64.6]': the share and its 95 % interval, in percent."""
    low, high = wilson_interval(share, n)
    return f"{100 * share:.1f} % [{100 * low:.1f}, {100 * high:.1f}]"


Z_RISE = 2.5758293035489004  # the standard normal's 99.5 % quantile: a one-sided test at 0.5 %


def rate_rose(before: int, before_n: int, after: int, after_n: int, z: float = Z_RISE) -> bool:
    """Whether `after` / after_n is significantly higher than `before` / before_n: the one-sided two-proportion
    z-test with the pooled rate (at the default z, 0.5 % one-sided: a demo checks five prompts per model and
    six models over three seeds, so a looser test would flag a model by chance in most such runs)."""
    if before_n <= 0 or after_n <= 0:
        raise ValueError(f"a rate needs at least one sample, got {before_n} and {after_n}")
    if not (0 <= before <= before_n and 0 <= after <= after_n):
        raise ValueError(f"counts {before}/{before_n} and {after}/{after_n} are not in [0, n]")
    pooled = (before + after) / (before_n + after_n)
    if pooled in (0.0, 1.0):
        return False
    spread = math.sqrt(pooled * (1 - pooled) * (1 / before_n + 1 / after_n))
    return (after / after_n - before / before_n) / spread > z
