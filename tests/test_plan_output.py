"""What `canon-titan plan` and `plan --search` print beside their figures: the error canon-titan's
own GPU runs of the run's kind of model measured (``canon_titan.plan.calibration``), a --top the
search could not fill, and none of torch's warnings about the fake world's collectives.

References: each GPU run planned again (the stored planned figures), the measured over planned
tokens/s worked out here from the points' figures, and the points a newer run of the same
configuration supersedes named by hand."""

import re

import pytest

from canon_titan.plan import calibration
from canon_titan.plan.calibration import POINTS, ModelKind, in_use
from canon_titan.plan.gpus import GPUS
from conftest import CONFIGS, REPO


@pytest.mark.slow
@pytest.mark.parametrize("point", in_use(), ids=lambda p: f"{p.label} ({p.gpu}, {p.date})")
def test_each_gpu_run_in_use_is_planned_as_stored_and_is_of_its_kind(point):
    """The band comes from the stored planned figures: each is what the planner says today (a change
    to the planner that moves one must store them again), and each point's kind is its run's."""
    from canon_titan.plan.planner import plan, resolve

    result = plan(
        str(REPO / "train_configs" / f"{point.recipe}.toml"),
        list(point.overrides),
        gpus=1,
        gpu=GPUS[point.gpu],
        advise=False,
    )
    assert result.tokens_per_s_per_gpu == pytest.approx(point.planned_tokens_per_s, rel=2e-3), (
        f"the planner now gives {result.tokens_per_s_per_gpu:,.0f} tokens/s for {point.label!r} "
        f"({point.measured_on}): store the planner's figures with "
        "scripts/benchmarks/plan_recipes.py --docs"
    )
    run, _ = resolve(
        str(REPO / "train_configs" / f"{point.recipe}.toml"),
        list(point.overrides),
        1,
        GPUS[point.gpu],
    )
    assert result.model_kind == calibration.kind_of(run) == point.kind


def test_a_kinds_band_spans_its_newest_runs_measured_over_planned_time():
    """LlamaCanon-1B on the Triton Canon op: its 2026-11-26 and -27 runs were measured again on
    2026-11-28 (after the backward kernels' rewrite, on a host of its own), so the band is that
    day's two runs' measured over planned time, the lowest and the highest. The points in use, and
    only they, have a stored planned figure."""
    kind = ModelKind("llama_canon")
    band = calibration.band(kind)
    expected = [p for p in POINTS if p.kind == kind and p.date == "2026-11-28"]
    assert (
        sorted(p.label for p in band.points) == sorted(p.label for p in expected)
        and len(expected) == 2
    )
    ratios = [p.planned_tokens_per_s / p.measured_tokens_per_s for p in expected]
    assert (band.low, band.high) == (min(ratios), max(ratios))
    assert not band.within_goal
    assert set(calibration.planned()) == {p.key for p in in_use()}
    assert {p.kind for p in in_use()} >= {
        ModelKind("llama"),
        kind,
        ModelKind("llama_canon", "tensorwise"),
    }


def test_a_kind_without_gpu_runs_or_within_the_goal_carries_no_band(monkeypatch):
    from canon_titan.plan import report

    assert (
        calibration.band(ModelKind("gla5")) is None
        and report.carried_band(ModelKind("gla5")) is None
    )
    assert "no canon-titan GPU run of this kind yet" in report.band_lines(ModelKind("gla5"))[0]
    assert report.carried_band(ModelKind("llama_canon")) is not None
    monkeypatch.setattr(
        calibration, "planned", lambda: {p.key: 1.05 * p.measured_tokens_per_s for p in in_use()}
    )
    assert calibration.band(ModelKind("llama_canon")).within_goal
    assert report.carried_band(ModelKind("llama_canon")) is None
    assert (
        "within 10% of its 2 GPU run(s) (x1.05 the planned time)"
        in report.band_lines(ModelKind("llama_canon"))[0]
    )


def test_a_plan_prints_its_kinds_band_beside_its_times_and_gpu_hours_and_no_dtensor_warning():
    """The debug LlamaCanon as HSDP 2 x 2 x TP 2 on 8 GPUs: the step, tokens/s, wall time and
    GPU-hours each with the planned figure times the kind's lowest and highest measured over planned
    time, in the table and the JSON, and the runs it comes from; torch's DTensor warning that the
    gradient norm's redistribution takes two all-reduces (a fake collective) is not logged."""
    import logging

    import torch.distributed.tensor._redistribute as redistribute

    from canon_titan.plan import report
    from canon_titan.plan.planner import plan

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    logged, keep, dtensor = [], Keep(), logging.getLogger(redistribute.__name__)
    redistribute._warned_flatten_issues.clear()  # torch warns once per mesh and process
    overrides = [
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--training.steps",
        "2000000",
    ]
    dtensor.addHandler(keep)
    try:
        result = plan(
            str(CONFIGS["llama_canon"]), overrides, gpus=8, gpu=GPUS["h100"], advise=False
        )
    finally:
        dtensor.removeHandler(keep)
    assert not any("While redistributing" in message for message in logged)

    runs = [p for p in calibration.in_use() if p.kind == ModelKind("llama_canon")]
    low = min(p.planned_tokens_per_s / p.measured_tokens_per_s for p in runs)
    high = max(p.planned_tokens_per_s / p.measured_tokens_per_s for p in runs)
    out = report.as_dict(result)
    assert out["step_seconds_measured_band"] == pytest.approx(
        [result.step_s * low, result.step_s * high]
    )
    assert out["wall_seconds_measured_band"] == pytest.approx(
        [result.wall_s * low, result.wall_s * high]
    )
    assert out["gpu_hours_measured_band"] == pytest.approx(
        [result.gpu_hours * low, result.gpu_hours * high]
    )
    assert out["tokens_per_second_per_gpu_measured_band"] == pytest.approx(
        [result.tokens_per_s_per_gpu / high, result.tokens_per_s_per_gpu / low]
    )
    assert out["plan_error"]["time_ratio"] == pytest.approx([low, high])
    assert sorted(r["label"] for r in out["plan_error"]["runs"]) == sorted(p.label for p in runs)

    printed = report.text(result)
    assert (
        f"step: {result.step_s:.3f} s (GPU-measured range: {result.step_s * low:.3f} s to "
        f"{result.step_s * high:.3f} s)" in printed
    )
    assert (
        f"{result.gpu_hours:,.0f} GPU-hours (GPU-measured range: {result.gpu_hours * low:,.0f} to "
        f"{result.gpu_hours * high:,.0f})" in printed
    )
    assert (
        f"{result.tokens_per_s_per_gpu:,.0f} tokens/s per GPU (GPU-measured range: "
        f"{result.tokens_per_s_per_gpu / high:,.0f} to {result.tokens_per_s_per_gpu / low:,.0f})"
        in printed
    )
    assert re.search(r"Run: .* \(GPU-measured range: .* to .*\) on 8 GPUs", printed)
    assert (
        f"Plan error (llama_canon, bf16): its GPU runs took x{low:.2f}-x{high:.2f} the planned time"
        in printed
    )
    assert all(f"  {p.label} ({p.gpu.upper()}, {p.date})" in printed for p in runs)


def _search_result(ranked: int, cut: int):
    from canon_titan.plan.search import Layout, Outcome, SearchResult

    def outcome(local: int, float8: str = "") -> Outcome:
        return Outcome(
            Layout(1, 8, 1, 1, 1, local, "none", float8=float8),
            True,
            40 * 2**30,
            10_000.0 * local,
            0.4,
            1.0,
            1000.0 * local,
        )

    return SearchResult(
        "x.toml",
        8,
        "H200 SXM 141GB",
        64,
        4096,
        1000,
        outcome(8),
        [outcome(8 - i) for i in range(ranked)],
        [outcome(8, "tensorwise")],
        {"planned in full": ranked + 2, **({"not planned in full (budget)": cut} if cut else {})},
        100.0,
        model_kind=ModelKind("llama_canon"),
        budget_s=580.0,
    )


def test_a_search_that_prints_fewer_than_top_says_why_with_the_table():
    from canon_titan.plan.search import text

    cut = text(_search_result(2, 8), 5)
    assert (
        "  Only 2 of --top 5: 8 more layout(s) were not planned in full within --budget-s "
        "580; a larger "
        "--budget-s plans them" in cut
    )
    assert "Only 2 of --top 5: no other layout tried fits" in text(_search_result(2, 0), 5)
    assert "Only" not in text(_search_result(5, 8), 5)


def test_search_rows_carry_the_band_of_their_kind_float8_apart():
    from canon_titan.plan.report import carried_band
    from canon_titan.plan.search import as_dict, text

    found = _search_result(2, 0)
    bf16, float8 = (
        carried_band(ModelKind("llama_canon")),
        carried_band(ModelKind("llama_canon", "tensorwise")),
    )
    assert (bf16.low, bf16.high) != (float8.low, float8.high)
    out = as_dict(found)
    for row, band in ((out["ranked"][0], bf16), (out["float8"][0], float8)):
        assert row["gpu_hours_measured_band"] == pytest.approx(
            [row["gpu_hours"] * band.low, row["gpu_hours"] * band.high]
        )
    printed = text(found, 5)
    hours = found.float8[0].gpu_hours
    assert (
        f"{hours:,.0f} GPU-hours for the run (GPU-measured range: {hours * float8.low:,.0f} to "
        f"{hours * float8.high:,.0f})" in printed
    )
    assert (
        "Plan error (llama_canon, bf16)" in printed
        and "Plan error (llama_canon, float8 tensorwise)" in printed
    )
