"""canon_titan/sweep/stats.py against scipy and numpy on fixed data: the t distribution, Wilson
intervals, the mean over seeds, and the paired difference (the paired t-test when items are fixed,
the exact variance of the crossed bootstrap when they are not); and the verdicts' wording."""

import math

import numpy as np
import pytest

from canon_titan.sweep import stats
from canon_titan.sweep.results import verdict
from canon_titan.sweep.scores import LossEval, SyntheticEval

st = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 8, 13, 30])
def test_the_t_distribution_is_scipys(df):
    for t in (0.0, 0.2, 1.0, 2.2, 4.3, 12.0):
        assert stats.t_within(t, df) == pytest.approx(st.t.cdf(t, df) - st.t.cdf(-t, df), abs=1e-12)
        assert stats.two_sided_p(t, df) == pytest.approx(2 * st.t.sf(t, df), abs=1e-12)
    assert stats.t_quantile(0.95, df) == pytest.approx(st.t.ppf(0.975, df), rel=1e-10)
    assert stats.t_quantile(0.95, None) == pytest.approx(st.norm.ppf(0.975), rel=1e-12)


def test_wilson_intervals_are_scipys_and_stay_around_the_proportion():
    """Issue 89.2: 0 of 21 printed as ``0.0 (-0-15)`` and a negative error bar; the bounds of 0 of
    n and n of n are the proportion itself, which rounding pushed outside."""
    for correct, total in [(1, 4), (3, 4), (23, 100), (99, 100), (0, 13), (13, 13), (5, 6)]:
        reference = st.binomtest(correct, total).proportion_ci(method="wilson")
        assert stats.wilson(correct, total) == pytest.approx(
            (reference.low, reference.high), abs=1e-12
        )
    for total in range(1, 301):
        for correct in (0, total):
            low, high = stats.wilson(correct, total)
            assert 0.0 <= low <= correct / total <= high <= 1.0, (correct, total)


def test_the_mean_over_seeds_has_scipys_t_interval():
    values = [0.81, 0.74, 0.93]
    spread = stats.across_seeds(values)
    low, high = st.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=st.sem(values))
    assert (spread.mean, spread.low, spread.high, spread.seeds) == pytest.approx(
        (np.mean(values), low, high, 3)
    )
    one = stats.across_seeds([0.5])
    assert (one.mean, one.low, one.high) == (0.5, None, None)


def test_one_value_per_seed_is_the_paired_t_test():
    a = {1: 2.31, 2: 2.44, 3: 2.29, 4: 2.52}  # e.g. losses of two arms, one per seed
    b = {1: 2.40, 2: 2.61, 3: 2.33, 4: 2.70}
    d = stats.paired_difference(a, b, same_items=True, resamples=200_000)
    reference = st.ttest_rel(list(a.values()), list(b.values()))
    interval = reference.confidence_interval()
    assert d.mean == pytest.approx(
        np.mean(np.subtract(list(a.values()), list(b.values()))), abs=1e-12
    )
    assert (d.low, d.high) == pytest.approx((interval.low, interval.high), rel=0.01)
    assert d.p == pytest.approx(reference.pvalue, rel=0.05)
    assert d.seeds == 4 and d.real


def exact_crossed_variance(rows: np.ndarray) -> float:
    """The variance of the mean of ``rows`` [S, n] when its seeds and its items are each drawn S
    and n times with replacement, independently: E[W W^T] = I + (1 - 1/S) 1 1^T for a multinomial
    W."""
    seeds, items = rows.shape
    ww = np.eye(seeds) + (1 - 1 / seeds) * np.ones((seeds, seeds))
    vv = np.eye(items) + (1 - 1 / items) * np.ones((items, items))
    second = np.trace(rows.T @ ww @ rows @ vv) / (seeds * items) ** 2
    return float(second - rows.mean() ** 2)


def inflated(rows: np.ndarray) -> np.ndarray:
    """Seed and item deviations scaled by sqrt(n / (n - 1)) (stats' unbiasing, written out)."""
    seeds, items = rows.shape
    grand = rows.mean()
    return (
        rows
        + (math.sqrt(seeds / (seeds - 1)) - 1) * (rows.mean(1, keepdims=True) - grand)
        + (math.sqrt(items / (items - 1)) - 1) * (rows.mean(0, keepdims=True) - grand)
    )


def test_paired_items_over_seeds_follow_the_crossed_bootstrap():
    rng = np.random.default_rng(7)
    ability = {0: 0.15, 1: 0.05, 2: 0.10}
    a = {s: (rng.random(60) < 0.55 + ability[s]).astype(int) for s in range(3)}
    b = {s: (rng.random(60) < 0.45).astype(int) for s in range(3)}
    d = stats.paired_difference(a, b, same_items=True, resamples=100_000)
    rows = np.stack([a[s] - b[s] for s in range(3)]).astype(float)
    se = math.sqrt(exact_crossed_variance(inflated(rows)))
    assert d.mean == pytest.approx(rows.mean(), abs=1e-12)
    assert (d.high - d.low) / 2 == pytest.approx(st.t.ppf(0.975, 2) * se, rel=0.02)
    assert d.p == pytest.approx(2 * st.t.sf(abs(rows.mean()) / se, 2), rel=0.05)
    # at least the paired t-test's spread over seeds, and at least the items' within one seed
    assert se >= 0.99 * math.sqrt(rows.mean(1).var(ddof=1) / 3)
    assert se >= 0.99 * math.sqrt(rows.mean(0).var(ddof=1) / 60)


def test_one_seed_compares_item_by_item():
    rng = np.random.default_rng(3)
    a = {5: (rng.random(200) < 0.7).astype(int)}
    b = {5: (rng.random(200) < 0.5).astype(int)}
    d = stats.paired_difference(a, b, same_items=True, resamples=100_000)
    diffs = (a[5] - b[5]).astype(float)
    se = diffs.std(ddof=1) / math.sqrt(len(diffs))  # the paired test over items (normal quantile)
    assert d.seeds == 1 and d.mean == pytest.approx(diffs.mean())
    assert (d.high - d.low) / 2 == pytest.approx(st.norm.ppf(0.975) * se, rel=0.02)


def test_arms_scored_on_other_items_are_resampled_apart():
    """Two test sets (an axis that changes the task): the items' variance is each arm's own, as a
    two-sample comparison's; one seed here, so nothing else adds to it."""
    rng = np.random.default_rng(11)
    a = {0: (rng.random(80) < 0.6).astype(int)}
    b = {0: (rng.random(50) < 0.3).astype(int)}
    d = stats.paired_difference(a, b, same_items=False, resamples=100_000)
    se = math.sqrt(a[0].var(ddof=1) / 80 + b[0].var(ddof=1) / 50)
    assert d.mean == pytest.approx(a[0].mean() - b[0].mean()) and not d.items_paired
    assert (d.high - d.low) / 2 == pytest.approx(st.norm.ppf(0.975) * se, rel=0.02)
    with pytest.raises(ValueError, match="same items"):
        stats.paired_difference(a, b, same_items=True)
    assert stats.paired_difference({1: [1]}, {2: [0]}, same_items=True) is None  # no shared seed


def test_verdicts_say_who_wins_by_how_much_and_whether_it_is_noise():
    accuracy, loss = SyntheticEval(100), LossEval()
    real = stats.Difference(0.41, 0.31, 0.50, 0.001, 3, True)
    assert (
        verdict(real, "llama_canon", "llama", "k=2", accuracy)
        == "llama_canon beats llama on k=2 by 41 points (31-50), real at 3 seeds"
    )
    behind = stats.Difference(-0.41, -0.50, -0.31, 0.001, 3, True)
    assert (
        verdict(behind, "llama_canon", "llama", "k=2", accuracy)
        == "llama beats llama_canon on k=2 by 41 points (31-50), real at 3 seeds"
    )
    noise = stats.Difference(0.04, -0.03, 0.11, 0.2, 3, True)
    assert (
        verdict(noise, "A", '""', "k=1", accuracy)
        == 'A vs "" on k=1: +4 points (-3 to 11), within seed noise'
    )
    one = stats.Difference(0.5, 0.4, 0.6, 1e-9, 1, True)
    assert verdict(one, "b", "a", "all", accuracy).endswith(
        "real over the test items (1 seed: seed noise not measured)"
    )
    lower = stats.Difference(-0.12, -0.2, -0.05, 0.01, 3, False)  # a's loss is lower: a wins
    assert (
        verdict(lower, "AbCD", '""', "loss", loss)
        == 'AbCD beats "" on loss by 0.12 (0.05-0.2), real at 3 seeds'
    )
