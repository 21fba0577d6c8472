"""``canon-titan plan --search`` (issue 45): the layouts it enumerates keep the global batch, what
it offers are full plans (handed back to ``plan`` they give the same figures), and its winner,
stepped on real gloo processes, is the run the plan described.

References: the config checks' own arithmetic of a layout's data-parallel size and accumulation
(``load``), hand-enumerated factorizations, ``plan`` itself for the offered rows, and a real
two-process run measured by FlopCounterMode, CommDebugMode, gloo's flight recorder and MemTracker
(as ``tests/test_plan.py`` holds a plan to a real run).
"""

import os
import re
from unittest.mock import patch

import pytest

from canon_titan.plan.gpus import GPUS
from conftest import CONFIGS, REPO

BASE = ["--training.seq_len", "128"]


def test_structures_are_every_factorization_the_checks_allow_by_hand():
    """8 GPUs, 8 per node, 4 layers, a global batch of 8: TP within the node, CP without PP (with
    FSDP, and with TP), PP dividing the layers; each leaves a data-parallel size dividing the
    batch."""
    from canon_titan.plan.search import structures

    got = set(structures(8, 8, 4, 8, cp_allowed=True))
    expected = {
        (1, 1, 1),
        (1, 1, 2),
        (1, 1, 4),
        (1, 1, 8),
        (1, 2, 1),
        (1, 4, 1),
        (2, 1, 1),
        (2, 2, 1),
        (2, 4, 1),
        (4, 1, 1),
        (4, 2, 1),
        (8, 1, 1),
        (2, 1, 2),
        (2, 1, 4),
        (4, 1, 2),
    }
    assert got == expected
    assert (1, 8, 1) not in set(structures(8, 8, 4, 8, cp_allowed=True))  # 8 stages of 4 layers
    assert all(cp == 1 for _, _, cp in structures(8, 8, 4, 8, cp_allowed=False))
    assert all(
        tp <= 4 for tp, _, _ in structures(16, 4, 4, 16, cp_allowed=True)
    )  # TP within a 4-GPU node


def test_every_local_batch_keeps_the_global_batch():
    """For every structure of 64 GPUs and a global batch of 1,536 (the LlamaCanon-8B recipe), each
    local batch the search offers resolves, through the config checks, to local x dp x
    accumulation = 1,536, and under PP to 1-2 microbatches of one sequence per stage."""
    from canon_titan.config import load
    from canon_titan.plan.search import Layout, local_batches, structures

    config = REPO / "train_configs" / "LlamaCanon-8B-Nemo-1T-lr0.003.toml"
    checked = 0
    for tp, pp, cp in structures(64, 8, 32, 1536, cp_allowed=True):
        dp = 64 // (tp * pp * cp)
        batches = local_batches(1536 // dp, pp)
        assert batches == sorted(batches, reverse=True) and batches
        for b in (batches[0], batches[-1]):
            layout = Layout(1, dp, tp, pp, cp, b, "none")
            with patch.dict(os.environ, WORLD_SIZE="64"):
                run = load(str(config), layout.overrides(1536), environment=False)
            assert run.data_parallel_size(64) == dp
            accumulation = run["training"]["global_batch_size"] // (
                run["training"]["local_batch_size"] * dp
            )
            assert run["training"]["local_batch_size"] * dp * accumulation == 1536
            if pp > 1:
                assert pp <= b <= 2 * pp
            checked += 1
    assert checked >= 30


class _Clock:
    """A clock that moves only as the fake planner below spends time."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _fake_planner(
    clock: _Clock,
    planned: list,
    probe_s: float,
    full_s: float,
    network_s: float = 0.0,
    gather_s: float = 0.0,
    kept_share: float = 1.0,
    replicate_s: float = 0.0,
):
    """Stands in for ``plan`` in the search's worker (one worker: in-process): a probe (few layers)
    costs ``probe_s`` of the clock, a full plan ``full_s``. Every layout fits in a few GB; less TP
    and CP and a larger local batch are faster; keeping the gathered weights a little, float8 more.
    An FSDP shard group that spans nodes adds ``network_s`` per rank in it and ``gather_s`` / TP
    (its share of the weights' bytes), of which ``kept_share`` remains when the gathered weights are
    kept; HSDP's all-reduce across its replicas adds ``replicate_s``."""

    def figures(config, overrides, gpus, gpu, gpus_per_node, attention):
        value = {
            flag: overrides[i + 1] for i, flag in enumerate(overrides) if flag.startswith("--")
        }
        probe = "--model.n_layers" in value
        clock.now += probe_s if probe else full_s
        if not probe:
            planned.append(dict(value))
        local = int(value.get("--training.local_batch_size", 1))
        tp = int(value.get("--parallelism.tensor_parallel_degree", 1))
        cp = int(value.get("--parallelism.context_parallel_degree", 1))
        shard = int(value.get("--parallelism.data_parallel_shard_degree", gpus // (tp * cp)))
        kept = value.get("--parallelism.fsdp_reshard_after_forward") == "never"
        spans = shard * tp * cp > gpus_per_node
        network = (
            (network_s * shard + gather_s / tp) * (kept_share if kept else 1.0) if spans else 0.0
        )
        replicas = int(value.get("--parallelism.data_parallel_replicate_degree", 1))
        step = 1 + 0.2 * tp + 0.5 * cp + 1 / local
        step *= 0.8 if value.get("--float8.enable") == "true" else 1.0
        step *= 0.99 if kept else 1.0
        step += network + (replicate_s if replicas > 1 else 0.0)
        return {
            "fits": True,
            "device_bytes": local * 2**28,
            "live_bytes": local * 2**27,
            "step_s": step,
            "tokens_per_s_per_gpu": 1e4 / step,
            "mfu": 0.5,
            "gpu_hours": step,
            "accumulation": 1,
            "seconds": probe_s if probe else full_s,
        }

    return figures


def _search_on_the_clock(monkeypatch, budget_s: float):
    from canon_titan.plan import search as search_module

    clock, planned = _Clock(), []
    monkeypatch.setattr(search_module, "time", clock)
    monkeypatch.setattr(search_module, "_plan_figures", _fake_planner(clock, planned, 1.0, 60.0))
    found = search_module.search(
        str(CONFIGS["llama"]),
        BASE,
        gpus=8,
        gpu=GPUS["h100"],
        top=3,
        budget_s=budget_s,
        workers=1,
        pipelines=False,
    )
    return found, [
        (
            v["--training.local_batch_size"],
            v["--parallelism.tensor_parallel_degree"],
            v["--parallelism.fsdp_reshard_after_forward"],
            v["--float8.enable"],
        )
        for v in planned[1:]
    ]  # after the config's own


@pytest.mark.parametrize("budget_s", [120.0, 200.0, 450.0])
def test_the_budget_bounds_the_search_and_goes_first_to_what_it_prints(monkeypatch, budget_s):
    """On a simulated clock (the config's own plan and every full plan 60 s, a probe 1 s; the debug
    config on 8 GPUs probes 5 layouts, 10 probes): the search ends within its budget and plans in
    full the first (budget - 70) // 60 layouts of what an ample budget plans, in the same order;
    that order is three layouts to print, the probes' best one's variant (keeping the gathered
    weights) and float8 (tensorwise, rowwise), float8 of the variant that won, then the rest."""
    ample, order = _search_on_the_clock(monkeypatch, 7200.0)
    assert "not planned in full (budget)" not in ample.tried
    assert all(p[2:] == ("default", "false") for p in order[:3])
    assert order[3][2:] == ("never", "false") and order[4][2:] == order[5][2:] == (
        "default",
        "true",
    )
    assert order[6][2:] == order[7][2:] == ("never", "true")  # the variant won: its float8 next
    assert ample.ranked[0].layout.reshard == "never"  # the fake planner's variant wins
    assert {o.layout.float8 for o in ample.float8} == {"tensorwise", "rowwise"}

    found, cut = _search_on_the_clock(monkeypatch, budget_s)
    assert found.seconds <= budget_s
    assert cut == order[: int(budget_s - 70) // 60]
    assert found.tried["not planned in full (budget)"] >= 1
    assert len(found.ranked) == sum(p[3] == "false" for p in cut)
    assert len(found.float8) == sum(p[3] == "true" for p in cut)
    if not found.ranked:
        from canon_titan.plan.search import text

        assert "raise --budget-s" in text(found, 3)


def test_probing_stops_within_a_round_at_its_share_of_the_budget_and_leaves_time_for_full_plans(
    monkeypatch,
):
    """Probes as slow as a loaded machine makes an 8B model's (30 s each, two a layout; the config's
    own plan and a full plan 60 s), budget 400 s: the debug config on 8 GPUs probes its 5 layouts in
    one round of three chunks of two layouts (2 per worker). By hand: the own plan ends at 60 s, the
    first chunk at 180, the second at 300, past the probes' share (0.6 x 400 = 240), so the third is
    not started and one full plan (60 s) fits in the 100 s left. A search that checked its share
    only between rounds would end the round at 420 s, past the budget, and offer nothing."""
    from canon_titan.plan import search as search_module

    clock, planned = _Clock(), []
    monkeypatch.setattr(search_module, "time", clock)
    monkeypatch.setattr(search_module, "_plan_figures", _fake_planner(clock, planned, 30.0, 60.0))
    found = search_module.search(
        str(CONFIGS["llama"]),
        BASE,
        gpus=8,
        gpu=GPUS["h100"],
        top=3,
        budget_s=400.0,
        workers=1,
        pipelines=False,
    )
    assert found.tried["probed"] == 4
    assert found.seconds <= 400.0
    assert len(planned) == 2 and len(found.ranked) == 1  # the own plan, then the probes' best


def test_float8_layouts_of_a_config_that_gathers_in_float8_are_runs():
    """A config with FSDP's float8 all-gather (tensor-wise only): its tensor-wise float8 layouts
    keep it, its row-wise ones gather in the param dtype (else the config check refuses them), and
    its bf16 ones ignore it as float8 being off does."""
    from canon_titan.config import load
    from canon_titan.plan.search import Layout

    base = [
        "--float8.enable",
        "--float8.emulate",
        "--float8.recipe_name",
        "tensorwise",
        "--float8.enable_fsdp_float8_all_gather",
        "true",
        "--float8.precompute_float8_dynamic_scale_for_fsdp",
        "true",
    ]
    for float8, gathers in (("tensorwise", True), ("rowwise", False), ("", False)):
        layout = Layout(1, 2, 1, 1, 1, 2, "none", float8=float8)
        with patch.dict(os.environ, WORLD_SIZE="2"):
            run = load(str(CONFIGS["llama"]), [*base, *layout.overrides(4)], environment=False)
        f8 = run["float8"]
        assert (f8["enable"], f8["recipe_name"] if f8["enable"] else "") == (bool(float8), float8)
        assert (f8["enable"] and f8["enable_fsdp_float8_all_gather"]) == gathers, float8


def test_a_probe_pair_extrapolates_by_hand_and_never_below_its_live_peak():
    """Time and the live peak are linear in the layers. By hand, 32 layers: step 1.0 + 31 x 0.25 =
    8.75 s over 2 accumulation groups; reserved 20 + 31 x 2 = 82 GB, live 10 + 31 x 2 = 72 GB plus
    the larger slack (10 GB): 82 GB. The pair of LlamaCanon-8B, HSDP 8x2 x CP 4, local 96 on 64
    H100s (its reserved peak falls from one layer to two, 84.9 and 84.7 GB; live 54.7 and 73.7): the
    reserved peak extrapolates to 78.7 GB, a fit, the live one to 643 GB, plus 30.2 GB of slack:
    674 GB (planned in full: 647 GB). A failed probe: no figures."""
    from canon_titan.plan.search import extrapolate

    GB = 1e9
    pair = [
        {"device_bytes": 20 * GB, "live_bytes": 10 * GB, "step_s": 1.0, "accumulation": 2},
        {"device_bytes": 22 * GB, "live_bytes": 12 * GB, "step_s": 1.25, "accumulation": 2},
    ]
    memory, group_s, accumulation = extrapolate(pair, 32)
    assert (memory, group_s, accumulation) == (pytest.approx(82 * GB), pytest.approx(8.75 / 2), 2)
    falling = [
        {"device_bytes": 84.9 * GB, "live_bytes": 54.7 * GB, "step_s": 0.8, "accumulation": 1},
        {"device_bytes": 84.7 * GB, "live_bytes": 73.7 * GB, "step_s": 1.0, "accumulation": 1},
    ]
    assert extrapolate(falling, 32)[0] == pytest.approx((54.7 + 31 * 19.0 + 30.2) * GB)
    assert extrapolate([pair[0], {"error": "out of memory"}], 32) is None


def test_a_structure_fastest_as_hsdp_is_found_though_its_fsdp_form_probes_last(monkeypatch):
    """16 GPUs on two nodes of 8, a global batch of 256, the fake planner's network cost 0.2 s per
    rank of an FSDP group that spans nodes. By hand (step = 1.5 + 0.2 TP + 1/local + network): as
    FSDP every structure spans nodes and TP 1, with 16 ranks in its group, probes slowest (4.96 s,
    against 3.12 s for TP 4); as HSDP 2x8 each shard group is one node, and TP 1 at local 16 is the
    fastest layout of all (1.76 s; HSDP 2x4 with TP 2 1.93 s). The search must offer it first; a
    search that tried HSDP only as a variant of its best-probed structures would not find it."""
    from canon_titan.plan import search as search_module

    clock, planned = _Clock(), []
    monkeypatch.setattr(search_module, "time", clock)
    monkeypatch.setattr(
        search_module, "_plan_figures", _fake_planner(clock, planned, 1.0, 60.0, network_s=0.2)
    )
    found = search_module.search(
        str(CONFIGS["llama"]),
        [*BASE, "--training.global_batch_size", "256"],
        gpus=16,
        gpu=GPUS["h100"],
        top=3,
        budget_s=7200.0,
        workers=1,
        pipelines=False,
    )
    best = found.ranked[0].layout
    assert (best.dp_replicate, best.dp_shard, best.tp, best.cp, best.local_batch) == (
        2,
        8,
        1,
        1,
        16,
    )
    assert found.tried["HSDP forms"] >= 2  # TP 1 (2x8) and TP 2 (2x4) at least
    fsdp_tp1 = [
        o for o in found.ranked if (o.layout.dp_replicate, o.layout.tp, o.layout.cp) == (1, 1, 1)
    ]
    assert all(o.step_s > 2 * found.ranked[0].step_s for o in fsdp_tp1)


def test_keeping_the_gathered_weights_is_tried_on_the_best_fsdp_form_though_hsdp_ranks_higher(
    monkeypatch,
):
    """16 GPUs on two nodes of 8, a global batch of 256. The fake planner: an FSDP group that spans
    nodes pays 0.3 s / TP of all-gathers and reduce-scatters, a fifth of it when the gathered
    weights are kept; HSDP pays 0.1 s for its all-reduce across nodes. By hand (compute 1.5 + 0.2 TP
    + 1/local, x0.99 keeping the gathered weights): HSDP 2x8 TP 1 at local 16 1.8625 s, kept 1.8449;
      HSDP 2x4
    TP 2 2.0313; FSDP 16 TP 1 2.0625 (the fastest FSDP form: TP 2 2.0813), fourth of those planned
    after the first variant, and kept 1.8049: the fastest of all. A search that tries the variant
    only on its best three would offer HSDP 2x8 kept (1.8449)."""
    from canon_titan.plan import search as search_module

    clock, planned = _Clock(), []
    monkeypatch.setattr(search_module, "time", clock)
    monkeypatch.setattr(
        search_module,
        "_plan_figures",
        _fake_planner(clock, planned, 1.0, 60.0, gather_s=0.3, kept_share=0.2, replicate_s=0.1),
    )
    found = search_module.search(
        str(CONFIGS["llama"]),
        [*BASE, "--training.global_batch_size", "256"],
        gpus=16,
        gpu=GPUS["h100"],
        top=3,
        budget_s=7200.0,
        workers=1,
        pipelines=False,
    )
    steps = {
        (
            o.layout.dp_replicate,
            o.layout.dp_shard,
            o.layout.tp,
            o.layout.cp,
            o.layout.local_batch,
            o.layout.reshard,
        ): o.step_s
        for o in found.ranked
    }
    assert steps[(2, 8, 1, 1, 16, "default")] == pytest.approx(1.8625)
    assert steps[(1, 16, 1, 1, 16, "default")] == pytest.approx(2.0625)
    best = found.ranked[0]
    assert (
        best.layout.dp_replicate,
        best.layout.dp_shard,
        best.layout.tp,
        best.layout.cp,
        best.layout.local_batch,
        best.layout.reshard,
    ) == (1, 16, 1, 1, 16, "never")
    assert best.step_s == pytest.approx(1.5 * 0.99 + 1 / 16 * 0.99 + 0.2 * 0.99 + 0.06)
    assert sum(s < 2.0625 for s in steps.values()) >= 3  # the FSDP form ranked below the best three


@pytest.fixture(scope="module")
def found():
    from canon_titan.plan.search import search

    # a budget that would probe pipeline layouts, told not to unless nothing else fits (the README
    # table's search)
    return search(
        str(CONFIGS["llama"]),
        BASE,
        gpus=2,
        gpu=GPUS["h100"],
        top=5,
        budget_s=7200,
        workers=1,
        pipelines=False,
    )


@pytest.mark.slow
def test_a_search_offers_full_plans_that_keep_the_global_batch(found):
    """At least three layouts fit; they are sorted fastest first; none changes the global batch;
    float8 ones are listed apart; the winner's overrides handed back to ``plan`` give its
    figures."""
    from canon_titan.config import load
    from canon_titan.plan.planner import plan

    assert len(found.ranked) >= 3
    assert found.tried["pipeline layouts not probed (a layout without PP fits)"] >= 1
    assert all(o.layout.pp == 1 for o in found.ranked + found.float8)
    speeds = [o.tokens_per_s_per_gpu for o in found.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(not o.layout.float8 for o in found.ranked) and all(
        o.layout.float8 for o in found.float8
    )
    for o in found.ranked + found.float8:
        with patch.dict(os.environ, WORLD_SIZE="2"):
            run = load(
                str(CONFIGS["llama"]),
                [*BASE, *o.layout.overrides(found.global_batch)],
                environment=False,
            )
        assert run["training"]["global_batch_size"] == found.global_batch == 8
        assert (
            found.global_batch % (run["training"]["local_batch_size"] * run.data_parallel_size(2))
            == 0
        )
        assert o.fits
    best = found.ranked[0]
    again = plan(
        str(CONFIGS["llama"]),
        [*BASE, *best.layout.overrides(found.global_batch)],
        gpus=2,
        gpu=GPUS["h100"],
        advise=False,
    )
    assert again.tokens_per_s_per_gpu == pytest.approx(best.tokens_per_s_per_gpu, rel=1e-9)
    assert again.worst.device_bytes == best.device_bytes
    assert best.tokens_per_s_per_gpu >= found.recipe.tokens_per_s_per_gpu


@pytest.mark.slow
def test_the_winner_written_as_toml_is_the_same_run(found, tmp_path):
    from canon_titan.config import load
    from canon_titan.plan.search import write_toml

    path = tmp_path / "winner.toml"
    write_toml(found, str(CONFIGS["llama"]), BASE, str(path))
    best = found.ranked[0].layout
    with patch.dict(os.environ, WORLD_SIZE="2"):
        written = load(str(path), [], environment=False)
        direct = load(
            str(CONFIGS["llama"]), [*BASE, *best.overrides(found.global_batch)], environment=False
        )
    for section in ("training", "parallelism", "activation_checkpoint", "float8", "model"):
        assert written[section] == direct[section], section


@pytest.mark.slow
def test_the_winner_stepped_on_real_processes_is_the_planned_run(found, tmp_path):
    """The top layout on two real gloo processes: FLOPs equal FlopCounterMode's, collectives by kind
    CommDebugMode's, bytes per group what gloo recorded, the activation peak within 10% of
    MemTracker's (the gathered parameters on MemTracker's side of the line); parameters, gradients,
    optimizer state and every collective's bytes by kind, group and phase equal to the real step
    recorded op by op."""
    from canon_titan.plan.planner import _categories
    from canon_titan.plan.recorder import memory_peak
    from test_plan import assert_plan_is_the_real_run, plan_step, real_run, summary

    overrides = [*BASE, *found.ranked[0].layout.overrides(found.global_batch)]
    real, measured = real_run(CONFIGS["llama"], overrides, 2, tmp_path)
    step = plan_step(CONFIGS["llama"], overrides, 2)
    # MemTracker files the gathered (unsharded) parameters under PARAM (it registers a module's
    # parameters as its forward starts, when FSDP has swapped in the gathered ones); kept after the
    # forward (fsdp_reshard_after_forward never) they are alive at the activation peak, where the
    # plan calls them gathered parameters.
    gathered = memory_peak(step.trace, _categories(step)).by_category.get("gathered parameters", 0)
    assert_plan_is_the_real_run(summary(step), real, measured, gathered)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--gpus", "2", "--top", "3"], "--top applies to --search only"),
        (["--gpus", "2", "--write", "w.toml"], "--write applies to --search only"),
        (["--gpus", "2", "--search", "--top", "0"], "--top must be >= 1"),
        (["--gpus", "2", "--search", "--write", "w.txt"], "expected a .toml path"),
        (["--gpus", "2", "--search", "--budget-s", "0"], "--budget-s must be > 0"),
        (["--gpus", "2", "--search", "--workers", "0"], "--workers must be >= 1"),
    ],
)
def test_bad_search_arguments_are_one_line_and_exit_2(args, message, capsys):
    from canon_titan.cli.plan import main

    assert main([str(CONFIGS["llama"]), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def _layout_from_text(text: str):
    """``Layout.describe`` read back: the README's words for a layout, as the layout itself."""
    from canon_titan.plan.search import Layout

    return Layout.from_text(text)


def _search_rows() -> list[list[str]]:
    text = (REPO / "docs" / "benchmarks" / "planner.md").read_text()
    body = text.split("<!-- plan:search -->", 1)[1].split("<!-- /plan:search -->", 1)[0]
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in body.splitlines()
        if line.startswith("| ") and not line.startswith(("| recipes", "|---"))
    ]


@pytest.mark.slow
def test_the_readme_search_table_is_what_the_search_offers(monkeypatch):
    """Every row of the README's search table names shipped recipes and a cluster of a known GPU;
    its layouts, read back, are runs the config checks accept on those GPUs with the recipe's global
    batch (the recipe's own layout is the recipe's); its saving is its two figures'. The row of the
    smallest model, planned again with its best layout's overrides, gives its GPU-hours."""
    monkeypatch.syspath_prepend(REPO / "scripts" / "benchmarks")
    from canon_titan.config import load
    from canon_titan.plan.planner import plan
    from plan_recipes import recipe_label, recipes

    by_label = {recipe_label(entries): entries for entries in recipes(None).values()}
    gpus_by_name = {gpu.name: key for key, gpu in GPUS.items()}
    rows = _search_rows()
    assert len(rows) >= 4
    for label, cluster, own, own_hours, best, best_hours, saving, float8 in rows:
        config = str(by_label[label][0][0])
        gpus, gpu_name = cluster.split(" x ", 1)
        gpus = int(gpus)
        assert gpu_name in gpus_by_name, cluster
        monkeypatch.setenv("WORLD_SIZE", str(gpus))
        recipe = load(config, [], environment=False)
        global_batch = recipe["training"]["global_batch_size"]
        layouts = (
            [best]
            + ([own] if own != "does not fit" else [])
            + ([float8.rsplit(" (", 1)[0]] if float8 != "-" else [])
        )
        for text in layouts:
            layout = _layout_from_text(text)
            run = load(config, layout.overrides(global_batch), environment=False)
            dp = run.data_parallel_size(gpus)
            assert global_batch % (layout.local_batch * dp) == 0, (label, cluster, text)
        if own != "does not fit":
            assert _layout_from_text(own).local_batch == recipe["training"]["local_batch_size"]
            assert _layout_from_text(own).ac == recipe["activation_checkpoint"]["mode"]
            best, mine = (float(hours.replace(",", "")) for hours in (best_hours, own_hours))
            assert saving == f"{100 * (1 - best / mine):.0f}%"

    size = lambda row: int(re.search(r"-(\d+)B-", row[0]).group(1))  # noqa: E731
    label, cluster, _, _, best, best_hours, _, _ = min(
        rows, key=lambda row: (size(row), int(row[1].split()[0]))
    )
    gpus, gpu_name = int(cluster.split(" x ")[0]), cluster.split(" x ", 1)[1]
    config = str(by_label[label][0][0])
    recipe = load(config, [], environment=False)
    tokens = recipe["training"]["global_batch_size"] * recipe["training"]["seq_len"]
    result = plan(
        config,
        _layout_from_text(best).overrides(recipe["training"]["global_batch_size"]),
        gpus=gpus,
        gpu=GPUS[gpus_by_name[gpu_name]],
        advise=False,
    )
    hours = 1e12 / tokens * result.step_s * gpus / 3600
    assert float(best_hours.replace(",", "")) == pytest.approx(hours, rel=2e-3)
