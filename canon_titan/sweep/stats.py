"""How far a sweep's numbers can be trusted: intervals over seeds and over test items, and a test of
every difference between two arms.

* ``wilson``: one cell's binomial interval over its test items (95%, inside [0, 1]).
* ``across_seeds``: the mean over seeds with its t interval (n - 1 degrees of freedom).
* ``paired_difference``: arm a minus arm b over the seeds both have, seed paired with seed and, when
  both were scored on the same items, item with item. Its spread comes from a crossed bootstrap:
  seeds and items resampled with replacement, each independently of the other, so that both the
  seed-to-seed noise of training and the finite test set are in it. Resampled deviations are scaled
  by sqrt(n / (n - 1)) (seeds and items each), which makes the bootstrap's variance the unbiased
  one: with items fixed it is the paired t-test's. The interval is the difference +- a t quantile
  (seeds - 1 degrees of freedom; the normal one for a single seed) times that standard error, so
  that three seeds are not taken for thirty; the p-value is the same t's.

The Student t distribution is computed here (integer degrees of freedom, Abramowitz and Stegun
26.7.3-4) so that the package needs no scipy. The tests hold all of it to scipy, and the crossed
bootstrap to its exact variance (numpy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

LEVEL = 0.95
RESAMPLES = 10_000
_Z = NormalDist().inv_cdf(0.5 + LEVEL / 2)


def wilson(correct: int, total: int) -> tuple[float, float]:
    """95% Wilson score interval of ``correct`` out of ``total``. At 0 or at ``total`` one bound is
    the proportion itself, which rounding pushes to either side of it (below 0, above 1, or past the
    proportion): the bounds are kept inside [0, 1] and around the proportion."""
    if total <= 0:
        raise ValueError(f"a binomial interval needs items, got total = {total}")
    p, z2 = correct / total, _Z * _Z
    centre = (p + z2 / (2 * total)) / (1 + z2 / total)
    half = _Z / (1 + z2 / total) * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total))
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


def t_within(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` (an integer >= 1) degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term, total = 1.0, 1.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + (s * math.cos(theta) * total if df > 1 else 0.0))
    term, total = 1.0, 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for k in range(1, df // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return s * total


def t_quantile(level: float, df: int | None) -> float:
    """The t with P(|T| <= t) = ``level`` (df None: the normal distribution's)."""
    if df is None:
        return NormalDist().inv_cdf(0.5 + level / 2)
    low, high = 0.0, 1.0
    while t_within(high, df) < level:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if t_within(mid, df) < level else (low, mid)
    return (low + high) / 2


def two_sided_p(t: float, df: int | None) -> float:
    if df is None:
        return 2 * (1 - NormalDist().cdf(abs(t)))
    return max(0.0, 1 - t_within(t, df))


@dataclass
class Spread:
    """A mean over seeds and its 95% interval (None with one seed: nothing to spread)."""

    mean: float
    low: float | None
    high: float | None
    seeds: int


def across_seeds(values: list[float]) -> Spread:
    values = np.asarray(values, dtype=float)
    mean = float(values.mean())
    if len(values) < 2:
        return Spread(mean, None, None, len(values))
    half = t_quantile(LEVEL, len(values) - 1) * float(values.std(ddof=1)) / math.sqrt(len(values))
    return Spread(mean, mean - half, mean + half, len(values))


@dataclass
class Difference:
    """Arm a minus arm b over ``seeds`` shared seeds."""

    mean: float
    low: float
    high: float
    p: float
    seeds: int
    items_paired: bool
    """Both arms were scored on the same test items (compared item by item)."""

    @property
    def real(self) -> bool:
        return self.p < 1 - LEVEL


def _scale(n: int) -> float:
    """What a deviation is multiplied by, less one, for a bootstrap over n draws to have the
    unbiased variance of their mean (sqrt(n / (n - 1)))."""
    return math.sqrt(n / (n - 1)) - 1 if n > 1 else 0.0


def _inflate(rows: np.ndarray, seeds: bool = True) -> np.ndarray:
    """``rows`` [seeds, items] with each item's (and, if ``seeds``, each seed's) deviation from the
    mean scaled by sqrt(n / (n - 1))."""
    mean = rows.mean()
    out = rows + _scale(rows.shape[1]) * (rows.mean(axis=0, keepdims=True) - mean)
    if seeds:
        out += _scale(rows.shape[0]) * (rows.mean(axis=1, keepdims=True) - mean)
    return out


def _resampled_means(
    rows: np.ndarray, seed_counts: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """The mean of ``rows`` [seeds, items] under each resample of its seeds (``seed_counts`` [B,
    seeds]: how often each seed was drawn) and of its items (drawn here)."""
    seeds, items = rows.shape
    item_counts = rng.multinomial(items, np.full(items, 1 / items), size=len(seed_counts))
    return np.einsum("bs,si,bi->b", seed_counts, rows, item_counts) / (seeds * items)


def paired_difference(
    a: dict[int, np.ndarray],
    b: dict[int, np.ndarray],
    *,
    same_items: bool,
    resamples: int = RESAMPLES,
    rng_seed: int = 0,
) -> Difference | None:
    """Arm a minus arm b on one metric. ``a`` and ``b`` map a seed to that cell's item scores (1/0,
    or one value for a metric without items, such as a loss). ``same_items``: both arms were scored
    on the same test items, in the same order (then compared item by item). None when the arms share
    no seed."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    rows_a = np.stack([np.atleast_1d(np.asarray(a[s], dtype=float)) for s in seeds])
    rows_b = np.stack([np.atleast_1d(np.asarray(b[s], dtype=float)) for s in seeds])
    if same_items and rows_a.shape != rows_b.shape:
        raise ValueError(f"same items, but {rows_a.shape[1]} item scores against {rows_b.shape[1]}")
    mean = float(rows_a.mean() - rows_b.mean())
    rng = np.random.default_rng(rng_seed)
    counts = rng.multinomial(len(seeds), np.full(len(seeds), 1 / len(seeds)), size=resamples)
    if same_items:
        draws = _resampled_means(_inflate(rows_a - rows_b), counts, rng)
    else:  # seeds paired (the difference's seed effect inflated, carried by a); items each arm's
        per_seed = rows_a.mean(axis=1) - rows_b.mean(axis=1)
        shift = _scale(len(seeds)) * (per_seed - per_seed.mean())
        draws = _resampled_means(
            _inflate(rows_a, seeds=False) + shift[:, None], counts, rng
        ) - _resampled_means(_inflate(rows_b, seeds=False), counts, rng)
    se = float(draws.std(ddof=1))
    df = len(seeds) - 1 or None
    if se == 0:
        return Difference(mean, mean, mean, 1.0 if mean == 0 else 0.0, len(seeds), same_items)
    half = t_quantile(LEVEL, df) * se
    return Difference(
        mean, mean - half, mean + half, two_sided_p(mean / se, df), len(seeds), same_items
    )
