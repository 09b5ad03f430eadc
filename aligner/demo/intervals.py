"""How sure a demo table's row is: the 95 % interval of a share measured on n held-out problems.

The Wilson score interval (written out here: it is three lines, and the project's dependencies carry no
statistics library). Unlike the normal approximation it stays inside [0, 1] and does not collapse to a point
at 0 % or 100 %, which demo rows reach (the random init scores 0 %).
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
