"""The CUDA allocator's mode of a training process (expandable segments, as TorchTitan's
run_train.sh sets, unless the environment configures the allocator) and the planner's model of it.
References: the rules of
``c10/cuda/CUDACachingAllocator.cpp`` with ``expandable_segments:True`` (pages of 2 MiB in the small
pool, 20 MiB in the large one; best fit by the size a block could grow to; growth at the lowest
unmapped range that holds the request; free pages unmapped before an out-of-memory), worked by
hand."""

import os
from types import SimpleNamespace

import pytest

from canon_titan.plan import planner
from canon_titan.plan.allocator import CachingAllocator, ExpandingAllocator, replay
from canon_titan.tools import cuda_allocator
from conftest import REPO

MIB = 1 << 20


@pytest.mark.parametrize(
    "env, expandable",
    [
        ({}, True),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}, True),
        (
            {
                "PYTORCH_ALLOC_CONF": "expandable_segments:True",
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
            },
            True,
        ),
    ],
)
def test_a_training_process_runs_with_expandable_segments_unless_the_environment_says_otherwise(
    monkeypatch, env, expandable
):
    """The mode the planner assumes is the one a training process sets itself: expandable segments
    where the environment leaves the allocator alone, the user's setting otherwise
    (PYTORCH_ALLOC_CONF first, as torch reads it)."""
    for name in cuda_allocator.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cuda_allocator.expandable_segments() == expandable
    cuda_allocator.use_expandable_segments()

    assert {name: os.environ.get(name) for name in cuda_allocator.SETTINGS} == (
        {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": None}
        if not env
        else {name: env.get(name) for name in cuda_allocator.SETTINGS}
    )
    assert cuda_allocator.expandable_segments() == expandable


def test_the_planner_replays_the_step_in_the_runs_allocator_mode(monkeypatch):
    """``reserved_peak`` hands the replay the mode a training process started from this environment
    would use (at 432670c it always modelled the default allocator, which no launch path uses
    now)."""
    seen = []
    monkeypatch.setattr(
        planner, "replay", lambda events, **kwargs: seen.append(kwargs["expandable"])
    )
    step = SimpleNamespace(
        trace=SimpleNamespace(collective_buffers={}, collective_buffer_kinds={}, memory_events=[]),
        group_names={},
        categories={},
    )
    for name in cuda_allocator.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    planner.reserved_peak(step)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    planner.reserved_peak(step)
    planner.reserved_peak(step, expandable=True)  # a run of another mode than this environment's
    assert seen == [True, False, True]


def test_an_expandable_segment_grows_by_pages_and_reuses_its_free_end():
    """30 MiB maps two 20 MiB pages (40); freed, then 50 MiB: the free 40 MiB at the end grows by
    one page (60 reserved), where the default allocator keeps the 30 MiB segment (rounded to 30) and
    adds a 50 MiB one (80). A small request maps a 2 MiB page of the small pool."""
    expanding = ExpandingAllocator()
    first = expanding.malloc(30 * MIB)
    assert expanding.reserved == 40 * MIB
    expanding.free(first)
    second = expanding.malloc(50 * MIB)
    assert (expanding.reserved, second.offset, second.size) == (60 * MIB, 0, 50 * MIB)
    default = CachingAllocator()
    default.free(default.malloc(30 * MIB))
    default.malloc(50 * MIB)
    assert default.reserved == 80 * MIB
    small = ExpandingAllocator()
    for _ in range(5):
        small.malloc(100)
    assert (small.reserved, small.allocated) == (2 * MIB, 5 * 512)
    small.malloc(MIB + 1)  # the large pool: a 20 MiB page of its own
    assert small.reserved == 22 * MIB


def test_best_fit_passes_over_the_block_that_borders_unmapped_space():
    """x 15 [0, 15), y 5 [15, 20), z 28 [20, 48) (pages to 60); x freed: free blocks [0, 15) and
    [48, 60), the second bordering unmapped space. 11 MiB takes [0, 15) (a 4 MiB rest), not the
    smaller [48, 60): best fit counts that one as able to grow. Then 14 MiB fits no free block and
    grows [48, 60) by a page: 80 reserved (plain best fit would have taken [48, 60) for the 11 and
    [0, 15) for the 14: 60)."""
    allocator = ExpandingAllocator()
    x, y, z = allocator.malloc(15 * MIB), allocator.malloc(5 * MIB), allocator.malloc(28 * MIB)
    assert [(b.offset // MIB, b.size // MIB) for b in (x, y, z)] == [(0, 15), (15, 5), (20, 28)]
    assert allocator.reserved == 60 * MIB
    allocator.free(x)
    eleven = allocator.malloc(11 * MIB)
    assert (eleven.offset, allocator.reserved) == (0, 60 * MIB)
    fourteen = allocator.malloc(14 * MIB)
    assert (fourteen.offset, allocator.reserved) == (48 * MIB, 80 * MIB)


def test_at_the_gpus_memory_free_pages_are_unmapped_and_the_mapping_tried_again():
    """On 100 MiB: a 20 [0, 20), b 40 [20, 60), c 20 [60, 80) (80 reserved); b freed; d 50 fits no
    free block and would map three pages at 80 (140): one retry unmaps b's two whole pages (40
    reserved), the hole [20, 60) is too small for 50, so d maps at 80 after all: 100 reserved,
    within the GPU. The default allocator releases b's whole segment and reserves a 50 MiB one:
    90."""
    events = [
        (0, 1, 20 * MIB),
        (1, 2, 40 * MIB),
        (2, 3, 20 * MIB),
        (3, 2, -40 * MIB),
        (4, 4, 50 * MIB),
    ]
    expanding = replay(events, steps=1, capacity=100 * MIB, expandable=True)
    assert (expanding.reserved, expanding.peak_reserved, expanding.retries) == (
        100 * MIB,
        100 * MIB,
        1,
    )
    default = replay(events, steps=1, capacity=100 * MIB)
    assert (default.reserved, default.retries) == (90 * MIB, 1)


def test_a_replayed_step_with_expandable_segments_reserves_less_of_its_fragmented_peak():
    """Parameters 100 MiB (persistent), a 40 MiB activation freed, then 50 MiB: the free 40 at the
    end grows by a page, 160 reserved (the default allocator: 190, a new 50 MiB segment); the second
    step reuses it."""
    events = [
        (0, 0, 100 * MIB),
        (1, 1, 40 * MIB),
        (2, 1, -40 * MIB),
        (3, 2, 50 * MIB),
        (4, 2, -50 * MIB),
    ]
    assert replay(events, persistent={0}, steps=1, expandable=True).peak_reserved == 160 * MIB
    assert replay(events, persistent={0}, steps=2, expandable=True).peak_reserved == 160 * MIB
    assert replay(events, persistent={0}, steps=1).peak_reserved == 190 * MIB


def test_a_gpu_run_of_record_is_planned_in_the_allocator_mode_it_had(monkeypatch):
    """The runs of 2026-11-22 to 28 ran without expandable segments (no launcher set them): the
    planner's tables plan each run with its own mode, whatever this process's environment says."""
    from canon_titan.plan.calibration import POINTS

    assert POINTS and all(not p.expandable_segments for p in POINTS if p.date <= "2026-11-28")
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "benchmarks"))
    import plan_recipes

    seen = []
    monkeypatch.setattr(
        plan_recipes,
        "plan",
        lambda *args, **kwargs: (
            seen.append(kwargs.get("expandable"))
            or SimpleNamespace(
                tokens_per_s_per_gpu=1.0, planner_s=0.0, worst=SimpleNamespace(reserved_bytes=2**30)
            )
        ),
    )
    plan_recipes.calibration_table(lambda message: None, {})
    assert seen == [p.expandable_segments for p in POINTS]
