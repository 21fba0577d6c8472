"""The stages of ``canon-titan plan --search`` one by one, by hand (the whole search is
``tests/test_plan_search.py``'s): what a shape needs probed next, and the estimates its probes
give."""

from __future__ import annotations

import pytest

from canon_titan.plan.search import Layout, probe_estimates, probes_needed

SHAPE = (Layout(1, 2, 1, 1, 1, 8, "none"), [8, 4, 2, 1], ["none", "selective", "full"])
CAPACITY = 80.0


def _at(ac: str, batch: int) -> Layout:
    return Layout(1, 2, 1, 1, 1, batch, ac)


def test_a_shape_is_probed_at_its_fastest_mode_first_and_interpolated_where_that_does_not_fit():
    """Nothing probed: the fastest mode at the largest batch. It does not fit (memory 100 > 80): the
    same mode at the smallest batch, and the next mode at the largest. That one fits: nothing more
    (a slower mode cannot be faster), but the first mode's smallest batch, still missing. A failed
    probe (None) counts as not fitting."""
    probed = {}
    assert probes_needed(SHAPE, probed, CAPACITY) == [_at("none", 8)]
    probed[_at("none", 8)] = (100.0, 4.0, 1)
    assert probes_needed(SHAPE, probed, CAPACITY) == [_at("none", 1), _at("selective", 8)]
    probed[_at("selective", 8)] = (70.0, 5.0, 1)
    assert probes_needed(SHAPE, probed, CAPACITY) == [_at("none", 1)]
    probed[_at("none", 1)] = (20.0, 1.0, 1)
    assert probes_needed(SHAPE, probed, CAPACITY) == []
    assert probes_needed(SHAPE, {_at("none", 8): None}, CAPACITY) == [
        _at("none", 1),
        _at("selective", 8),
    ]


def test_probe_estimates_by_hand():
    """Global batch 16 on 2 data-parallel ranks. ``none``: 100 at batch 8 (over 80), 20 at batch 1,
    linear in between: batch 4 is the largest that fits (20 + 3/7 x 80 = 54.3), 1 + 3/7 x 3 = 2.29 s
    a group, 2 groups a step (16 / (4 x 2)). ``selective`` fits at batch 8: 5 s, one group. Fastest
    first."""
    probed = {
        _at("none", 8): (100.0, 4.0, 1),
        _at("none", 1): (20.0, 1.0, 8),
        _at("selective", 8): (70.0, 5.0, 1),
    }
    estimates = probe_estimates([SHAPE], probed, CAPACITY, global_batch=16)
    assert estimates == [
        (pytest.approx(2 * (1 + 3 / 7 * 3)), _at("none", 4)),
        (5.0, _at("selective", 8)),
    ]
    assert probe_estimates([SHAPE], {_at("none", 8): None}, CAPACITY, 16) == []
