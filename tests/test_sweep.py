"""``canon-titan sweep`` (canon_titan/sweep/): the spec and its errors, matched budgets, the cells'
folders, the tables against a hand computation from the cells' own score files, an interrupted
sweep reusing what finished, the SLURM array path with the stand-ins of tests/slurm_standin.py; and
the playground and the quick start on top of it (issue 89: 2, 3, 17, 25)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import slurm_standin
from canon_titan.config import load
from canon_titan.sweep import budget as budgets
from canon_titan.sweep import plots, results
from canon_titan.sweep.cells import Task, task_label
from canon_titan.sweep.scores import SyntheticEval
from canon_titan.sweep.spec import Arm, SweepError, read_spec
from conftest import REPO, free_port, train_env

DEPO = REPO / "train_configs" / "playground" / "depo.toml"
TINY = {
    "training.seq_len": 64,
    "training.local_batch_size": 2,
    "training.global_batch_size": 2,
    "lr_scheduler.warmup_steps": 1,
    "checkpoint.interval": 3,
    "metrics.log_freq": 1,
    "model.n_layers": 1,
    "depo.N": 3,
    "depo.mini_vocab": 3,
}
"""A one-layer debug model on cycles of three one-token words (a guess is right a third of the
time)."""


def toml_value(value) -> str:
    return json.dumps(value)


def write_spec(
    path: Path,
    out: Path,
    *,
    seeds=(1, 2),
    axes=None,
    fixed=None,
    budget=None,
    count=6,
    config=DEPO,
    extra="",
) -> Path:
    axes = axes or {"model.name": ["llama", "llama_canon"]}
    lines = [
        "[sweep]",
        f"config = {toml_value(str(config))}",
        f"seeds = {list(seeds)}",
        f"out = {toml_value(str(out))}",
        "",
        "[axes]",
        *(f"{toml_value(k)} = {toml_value(v)}" for k, v in axes.items()),
        "",
        "[set]",
        *(
            f"{toml_value(k)} = {toml_value(v)}"
            for k, v in (TINY if fixed is None else fixed).items()
        ),
        "",
        "[budget]",
        *(budget or ["steps = 3"]),
        "",
        "[eval]",
        f"count = {count}",
        "",
        extra,
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def sweep(*args, cwd=REPO, env=None, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "canon_titan.cli", "sweep", *map(str, args)],
        cwd=cwd,
        env=env or train_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ----------------------------------------------------------------------------- the spec


@pytest.mark.parametrize(
    "body, message",
    [
        ("[sweep]\nseeds = [1]\n", "[sweep] config: required"),
        (
            '[sweep]\nconfig = "DEPO"\nseeds = [1, 1]\n',
            "[sweep] seeds: required, a list of distinct integers",
        ),
        (
            '[sweep]\nconfig = "DEPO"\nseeds = [1]\n[axes]\n"training.steps" = [1, 2]\n',
            "the budget sets every cell's steps",
        ),
        (
            '[sweep]\nconfig = "DEPO"\nseeds = [1]\n[axes]\n"job.seed" = [1, 2]\n',
            "list them in [sweep] seeds",
        ),
        (
            '[sweep]\nconfig = "DEPO"\nseeds = [1]\n[axes]\ncanon_set = ["", "A"]\n',
            "expected a config key",
        ),
        (
            '[sweep]\nconfig = "DEPO"\nseeds = [1]\n[budget]\nmatch = "flop"\n',
            "[budget] match: one of tokens, flops",
        ),
        ('[sweep]\nconfig = "DEPO"\nseeds = [1]\n[budget]\nsteps = 3\ntokens = 9\n', "give one"),
        ('[sweep]\nconfig = "DEPO"\nseeds = [1]\n[eval]\nkind = "lm"\n', "needs the lm-eval tasks"),
        (
            '[sweep]\nconfig = "DEPO"\nseeds = [1]\nexclude = [{ "model.name" = "x" }]\n',
            "is not an axis",
        ),
        ('[sweep]\nconfig = "DEPO"\nseeds = [1]\n[sweeps]\n', "[sweeps]: unknown section"),
    ],
)
def test_a_bad_spec_is_one_line_naming_its_key(tmp_path, body, message):
    spec = tmp_path / "s.toml"
    spec.write_text(body.replace("DEPO", str(DEPO)))
    with pytest.raises(SweepError) as error:
        read_spec(spec)
    assert (
        message in str(error.value)
        and str(spec) in str(error.value)
        and "\n" not in str(error.value)
    )


def test_a_bad_override_of_one_arm_is_refused_before_anything_trains(tmp_path):
    spec = write_spec(
        tmp_path / "s.toml", tmp_path / "out", axes={"model.canon_set": ["AB", "XYZ"]}
    )
    proc = sweep(spec)
    assert proc.returncode == 2 and "arm XYZ of" in proc.stderr and "canon_set" in proc.stderr, (
        proc.stderr
    )
    assert not (tmp_path / "out").exists()


def test_axes_cross_and_exclude_leaves_the_arms_named(tmp_path):
    spec = write_spec(
        tmp_path / "s.toml",
        tmp_path / "out",
        axes={"model.name": ["gla5", "mamba2"], "model.canon_set": ["", "b", "AbCD"]},
        extra="",
    )
    text = spec.read_text().replace(
        "[sweep]\n",
        '[sweep]\nexclude = [{ "model.name" = "gla5", "model.canon_set" = '
        '"b" }, { "model.name" = "mamba2", "model.canon_set" = "" }]\n',
        1,
    )
    spec.write_text(text)
    arms = read_spec(spec).arms()
    assert [a.label for a in arms] == ['gla5 ""', "gla5 AbCD", "mamba2 b", "mamba2 AbCD"]
    assert [a.folder for a in arms] == [
        "name=gla5,canon_set=-",
        "name=gla5,canon_set=AbCD",
        "name=mamba2,canon_set=b",
        "name=mamba2,canon_set=AbCD",
    ]
    assert arms[0].overrides() == [("model.name", "gla5"), ("model.canon_set", "")]
    pairs = [
        (b.label, a.label)
        for i, a in enumerate(arms)
        for b in arms[:i]
        if results.differ_in_one_axis(
            budgets.ArmRun(None, a, None, 0, 0), budgets.ArmRun(None, b, None, 0, 0)
        )
    ]
    assert pairs == [
        ('gla5 ""', "gla5 AbCD"),
        ("gla5 AbCD", "mamba2 AbCD"),
        ("mamba2 b", "mamba2 AbCD"),
    ]


# ----------------------------------------------------------------------------- budgets


def test_tokens_are_matched_and_each_cells_steps_printed_before_training(tmp_path):
    """An axis over the sequence length: the cells of 64-token windows get twice the steps of the
    128-token ones; the budget is what the first arm spends in [budget] steps."""
    spec = write_spec(
        tmp_path / "s.toml",
        tmp_path / "out",
        axes={"training.seq_len": [128, 64]},
        fixed={k: v for k, v in TINY.items() if k != "training.seq_len"},
        budget=["steps = 10"],
    )
    proc = sweep(spec, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert (
        "budget 2,560 tokens per cell (what 128 spends in 10 steps), matched on tokens"
        in proc.stdout
    )
    assert (
        "10 steps of 256 tokens: 2,560 tokens" in proc.stdout
        and "20 steps of 128 tokens: 2,560 tokens" in proc.stdout
    )
    assert proc.stdout.count(": 20 steps, to train") == 2 and not (tmp_path / "out").exists()


def test_flops_and_gpu_hours_budgets_are_the_planners(tmp_path, monkeypatch):
    """Canon-ABCD costs more FLOPs a step than no Canon (the planner counts its convolutions), so it
    gets fewer steps of the same budget; GPU-hours follow the planned step time on the GPU named."""
    from canon_titan.plan import planner
    from canon_titan.plan.gpus import find_gpu

    plans = {}

    def plan_once(config, overrides, **kwargs):  # the same run is planned once in this test
        key = (config, tuple(overrides))
        if key not in plans:
            plans[key] = real_plan(config, overrides, **kwargs)
        return plans[key]

    real_plan = planner.plan
    monkeypatch.setattr(planner, "plan", plan_once)
    fixed = {
        **TINY,
        "training.seq_len": 256,
        "training.local_batch_size": 8,
        "training.global_batch_size": 8,
    }
    args = budgets.override_args(list(fixed.items()))
    planned = {
        c: plan_once(
            str(DEPO),
            [*args, f"--model.canon_set={json.dumps(c)}"],
            gpus=1,
            gpu=find_gpu("h100"),
            advise=False,
        )
        for c in ("", "ABCD")
    }
    flops = {c: p.kinds[0].model_flops for c, p in planned.items()}
    assert flops["ABCD"] > flops[""]
    hours = {c: p.step_s / 3600 for c, p in planned.items()}
    for match, per_step in (("flops", flops), ("gpu_hours", hours)):
        budget = per_step[""] * 1000
        spec = write_spec(
            tmp_path / f"{match}.toml",
            tmp_path / "out",
            axes={"model.canon_set": ["", "ABCD"]},
            fixed=fixed,
            budget=[f'match = "{match}"', f"{match} = {budget!r}", 'gpu = "h100"'],
        )
        arm_runs, _ = budgets.plan_sweep(read_spec(spec))
        assert [a.steps for a in arm_runs] == [1000, round(budget / per_step["ABCD"])]
    assert len(plans) == 2 and arm_runs[1].steps < 1000


# ----------------------------------------------------------------- labels and tables (issue 89)


def test_results_name_the_task_that_ran_not_its_preset():
    """Issue 89.17: the quick start's table and plot said ``depo1``; it ran playground/depo with its
    N, K and separator."""
    assert task_label(str(DEPO)) == "playground/depo" and task_label("runs/my.toml") == "my"
    run = load(DEPO, environment=False)
    assert (
        budgets.describe(run)
        == "depo1 with N=8, K=2, mini_vocab=16, max_word_len=1, separator=true"
    )


def brevo_tables(folder: Path, count: int = 10):
    """A Brevo cell at 0% (every answer wrong), its raw scores as ``eval synthetic`` writes them and
    the sweep's scores made from them; its tables."""
    from synthetic_data.tasks import make_task, summarize

    task = make_task("brevo1", N=10)
    items = task.test_items(5, count)
    raw = {**summarize(task, items, [[] for _ in items]), "test_set": task.test_set(count)}
    (folder / "eval_synthetic.json").write_text(json.dumps(raw))
    record = SyntheticEval(count).write_scores(folder, 12.0)
    arm = budgets.ArmRun(
        Task("x.toml", "playground/brevo", "brevo1 with N=10"),
        Arm((("model.name", "llama"),)),
        None,
        512,
        512,
        steps=60,
    )
    result = results.collect(
        [arm], {("playground/brevo", "llama", 777): record}, SyntheticEval(count)
    )
    budget = budgets.Budget(
        "tokens",
        {"playground/brevo": 30720.0},
        {"playground/brevo": "what llama spends in 60 steps"},
    )
    return record, result, budget


def test_the_header_says_what_was_drawn_and_how_it_was_grouped(tmp_path):
    """Issue 89.3: Brevo draws 4 x count graphs and groups them by the query's depth afterwards; the
    header said "10 items per group" over groups of other sizes."""
    record, result, budget = brevo_tables(tmp_path)
    text = results.markdown(result, budget, SyntheticEval(10), [777])
    sizes = {name: g["total"] for name, g in record["groups"].items() if name != "all"}
    assert len(set(sizes.values())) > 1 and sum(sizes.values()) == 40  # not 10 each
    listed = ", ".join(f"{name} {n}" for name, n in sizes.items())
    assert (
        f"Test set: 40 graphs of 10 nodes, grouped by the query's depth (items per group: "
        f"{listed})." in text
    )
    assert "### playground/brevo (brevo1 with N=10)" in text


def playground(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/playground.py", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_group_at_zero_is_drawn_and_printed_inside_its_bounds(tmp_path):
    """Issue 89.2: a Wilson interval of 0 correct printed as ``0.0 (-0-15)`` and made matplotlib
    refuse its error bar, after the whole run; a replot then blamed the file."""
    record, result, budget = brevo_tables(tmp_path)
    assert all(g["correct"] == 0 for g in record["groups"].values())
    text = results.markdown(result, budget, SyntheticEval(10), [777])
    assert "(-0" not in text and "| llama | 0.0 (0-" in text
    table = results.as_json(result, budget, SyntheticEval(10), "s.toml")
    assert all(path.stat().st_size > 5_000 for path in plots.draw(table, tmp_path))
    (tmp_path / "results.json").write_text(json.dumps(table))
    replot = playground("--replot", tmp_path / "results.json", "--out", tmp_path / "again")
    assert replot.returncode == 0 and (tmp_path / "again" / "accuracy.png").is_file(), replot.stderr
    del table["tasks"]["playground/brevo"]["arms"]["llama"]["seeds"]
    (tmp_path / "broken.json").write_text(json.dumps(table))
    for path, message in (
        (tmp_path / "broken.json", "no 'seeds' in arm 'llama' of "),
        (tmp_path / "none.json", "cannot be read (No such file or directory)"),
    ):
        replot = playground("--replot", path, "--out", tmp_path)
        assert replot.returncode == 1 and message in replot.stderr, replot.stderr


def test_the_quick_start_says_it_wants_two_free_cores_and_when_the_machine_is_busy(monkeypatch):
    """Issue 89.25: its two trainings run side by side; the README's "~7 min" assumes two free
    cores, and a busy machine is said as the sweep starts."""
    from canon_titan.sweep import local

    readme = (REPO / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("scripts/quickstart.sh"))
    assert "~7 min" in line and "two free CPU cores" in line
    monkeypatch.setattr(os, "getloadavg", lambda: (3.4, 2.0, 1.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert local.load_note(2, 1) == (
        "the machine is busy: load average 3.4 on 2 cores before this sweep starts; its "
        "2 run(s) side by side want 2 free core(s), so they take longer than on an idle "
        "machine"
    )
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.2, 0.1))
    assert local.load_note(2, 1) is None
    assert (
        "train_configs/sweeps/quickstart.toml" in (REPO / "scripts" / "quickstart.sh").read_text()
    )


def test_a_folder_trained_as_another_cell_is_refused(tmp_path):
    spec = write_spec(tmp_path / "s.toml", tmp_path / "out")
    cell = budgets.cells_of(read_spec(spec), budgets.plan_sweep(read_spec(spec))[0])[0]
    cell.write_record()
    spec = write_spec(tmp_path / "s.toml", tmp_path / "out", fixed={**TINY, "optimizer.lr": 0.01})
    proc = sweep(spec, "--dry-run")
    assert (
        proc.returncode == 2
        and f"{cell.folder} was trained as another cell (overrides: [] there, "
        "['--optimizer.lr=0.01'] now)"
        in proc.stderr
    ), proc.stderr


# ----------------------------------------------------------------------------- end to end


def without_seconds(table: dict) -> dict:
    for arm in table["tasks"]["playground/depo"]["arms"].values():
        for seed in arm["seeds"].values():
            seed.pop("train_seconds")
    return table["tasks"]


def raw_scores(out: Path, arm: str, seed: int) -> dict:
    """A cell's own score file, as ``canon-titan eval synthetic`` wrote it."""
    cell = out / "cells" / "playground" / "depo" / f"name={arm}" / f"seed-{seed}"
    return json.loads((cell / "eval_synthetic.json").read_text())


def hand_table(out: Path, arms: list[str], seeds: list[int]) -> dict:
    """From the cells' own ``eval_synthetic.json``: per arm and group the seeds' accuracies, their
    mean and t interval (scipy), and per seed its Wilson interval (scipy)."""
    st = pytest.importorskip("scipy.stats")
    table = {}
    for arm in arms:
        per_seed = {}
        for seed in seeds:
            raw = raw_scores(out, arm, seed)
            per_seed[seed] = {
                **raw["groups"],
                "all": {
                    **raw["overall"],
                    "scores": [s for g in raw["groups"].values() for s in g["scores"]],
                },
            }
        groups = {}
        for group in per_seed[seeds[0]]:
            values = [per_seed[s][group]["correct"] / per_seed[s][group]["total"] for s in seeds]
            low, high = (
                st.t.interval(0.95, len(seeds) - 1, loc=np.mean(values), scale=st.sem(values))
                if np.std(values) > 0
                else (np.mean(values),) * 2
            )
            wilson = {
                s: st.binomtest(
                    per_seed[s][group]["correct"], per_seed[s][group]["total"]
                ).proportion_ci(method="wilson")
                for s in seeds
            }
            groups[group] = {
                "values": values,
                "mean": np.mean(values),
                "low": low,
                "high": high,
                "wilson": wilson,
                "scores": {s: np.asarray(per_seed[s][group]["scores"]) for s in seeds},
            }
        table[arm] = groups
    return table


@pytest.mark.slow
def test_a_tiny_sweep_end_to_end_and_again_after_an_interruption(tmp_path):
    """2 arms x 2 seeds, 3 steps each: the table is the hand computation from the cells' own score
    files (means, intervals, paired differences); then one cell loses its scores and one its whole
    folder (an interrupted sweep): the same command scores the first without training it, trains the
    second again, reuses the two others, and ends with the same table."""
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "tiny.toml", out)
    first = sweep(spec, "--jobs", "2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    written = json.loads((out / "results.json").read_text())
    hand = hand_table(out, ["llama", "llama_canon"], [1, 2])
    task = written["tasks"]["playground/depo"]
    assert (
        task["description"] == "depo1 with N=3, K=2, mini_vocab=3, max_word_len=1, separator=true"
    )
    assert list(task["arms"]) == ["llama", "llama_canon"] and task["groups"] == [
        "k=1",
        "k=2",
        "all",
    ]
    for arm, groups in hand.items():
        for group, expected in groups.items():
            got = task["arms"][arm]["groups"][group]
            assert got["mean"] == pytest.approx(expected["mean"], abs=1e-12)
            if got["low"] is not None:
                assert (got["low"], got["high"]) == pytest.approx(
                    (expected["low"], expected["high"]), abs=1e-9
                )
            for seed, interval in expected["wilson"].items():
                cell = task["arms"][arm]["seeds"][str(seed)]["groups"][group]
                assert cell["correct"] / cell["total"] == expected["values"][[1, 2].index(seed)]
                low, high = 100 * interval.low, 100 * interval.high
                assert (
                    results.seed_cell(cell, SyntheticEval(6))
                    == f"{100 * cell['value']:.1f} ({low:.0f}-{high:.0f})"
                )
    import test_sweep_stats as reference

    for comparison in task["comparisons"]:
        assert (comparison["a"], comparison["b"]) == ("llama_canon", "llama") and comparison[
            "items_paired"
        ]
        a, b = (hand[arm][comparison["group"]]["scores"] for arm in ("llama_canon", "llama"))
        rows = np.stack([a[s] - b[s] for s in (1, 2)]).astype(float)
        assert comparison["difference"] == pytest.approx(rows.mean(), abs=1e-12)
        variance = (
            reference.exact_crossed_variance(reference.inflated(rows)) if rows.std() > 0 else 0.0
        )
        half = pytest.importorskip("scipy.stats").t.ppf(0.975, 1) * variance**0.5
        assert (comparison["high"] - comparison["low"]) / 2 == pytest.approx(
            half, rel=0.03, abs=1e-12
        )
    assert len(task["comparisons"]) == 3
    report = (out / "results.md").read_text()
    assert "| llama_canon | llama | k=1 |" in report and (out / "accuracy.png").is_file()

    cells = out / "cells" / "playground" / "depo"
    (cells / "name=llama" / "seed-2" / "scores.json").unlink()
    import shutil

    shutil.rmtree(cells / "name=llama_canon" / "seed-1")
    again = sweep(spec, "--jobs", "2")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count(": reusing ") == 2
    assert "playground/depo llama seed 2: trained (" in again.stdout
    trained = [
        line for line in again.stdout.splitlines() if " + " in line and " train --config " in line
    ]
    assert len(trained) == 1 and "llama_canon seed 1]" in trained[0]
    # CPU training is deterministic: the retrained cell scores as before (its training time aside)
    again_table = json.loads((out / "results.json").read_text())
    assert without_seconds(again_table) == without_seconds(written)


# ----------------------------------------------------------------------------- SLURM


def slurm_env(tmp_path, submit, task: int, **extra) -> dict:
    bin_dir = slurm_standin.install(tmp_path / "bin")
    env = dict(
        train_env(),
        PATH=f"{bin_dir}:{train_env()['PATH']}",
        SLURM_JOB_NODELIST="node1",
        SLURM_NNODES="1",
        SLURM_SUBMIT_DIR=str(submit),
        SLURM_ARRAY_TASK_ID=str(task),
        SLURM_JOB_ID=str(100 + task),
        SLURM_GPUS_ON_NODE="1",
        SLURM_CPUS_PER_TASK="1",
        PYTHON=str(REPO / ".venv" / "bin" / "python"),
        **extra,
    )
    for name in ("GPUS_PER_NODE", "OMP_NUM_THREADS", "SLURM_GPUS_PER_NODE"):
        env.pop(name, None)
    return env


def test_the_array_script_is_train_slurms_and_a_preempted_task_is_not_scored(tmp_path):
    """One array task a cell, with train.slurm's signal and requeue options and the spec's nodes; a
    task whose training exits 75 (preempted: train.slurm requeued it) exits 75 unscored, to
    resume."""
    out = tmp_path / "out"
    spec = write_spec(
        tmp_path / "s.toml",
        out,
        fixed={**TINY, "training.global_batch_size": 16},
        extra="[slurm]\nnodes = 2\ngpus_per_node = 4\n",
    )
    proc = sweep(spec, "--slurm")
    assert proc.returncode == 0, proc.stderr
    script = out / "slurm" / "sweep.sbatch"
    text = script.read_text()
    for option in (
        "--array=0-3",
        "--nodes=2",
        "--gpus-per-node=4",
        "--signal=TERM@120",
        "--requeue",
        "--ntasks-per-node=1",
        f"--output={out / 'slurm'}/%A_%a.out",
    ):
        assert f"#SBATCH {option}\n" in text, option
    assert (
        f"sbatch {script}" in proc.stdout
        and len((out / "slurm" / "manifest.jsonl").read_text().splitlines()) == 4
    )
    submit = tmp_path / "submit"
    (submit / ".venv" / "bin").mkdir(parents=True)
    fake = submit / ".venv" / "bin" / "python"
    fake.write_text('#!/bin/bash\necho "$*" >> "$FAKE_LOG"\nexit "${FAKE_TORCHRUN_EXIT:-0}"\n')
    fake.chmod(0o755)
    env = slurm_env(tmp_path, submit, 1, FAKE_LOG=str(tmp_path / "calls"), FAKE_TORCHRUN_EXIT="75")
    task = subprocess.run(
        ["bash", str(script)], cwd=submit, env=env, capture_output=True, text=True, timeout=300
    )
    assert task.returncode == 75, task.stdout + task.stderr
    calls = (tmp_path / "calls").read_text()
    assert (
        "canon_titan.launch.torchrun" in calls
        and "--job.seed=2" in calls
        and '--model.name="llama"' in calls
    )
    assert "eval synthetic" not in calls
    cell = out / "cells" / "playground" / "depo" / "name=llama" / "seed-2"
    assert (cell / "cell.json").is_file() and not (cell / "scores.json").exists()


@pytest.mark.slow
def test_a_sweep_runs_as_a_slurm_array_and_is_collected(tmp_path):
    """Each array task trains its cell through train.slurm (stand-in srun, real torchrun), scores it
    and writes its scores; a task run again finds its cell scored; --collect gathers the table."""
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "s.toml", out, seeds=(1,), extra="[slurm]\ngpus_per_node = 1\n")
    assert sweep(spec, "--slurm").returncode == 0
    submit = tmp_path / "submit"
    submit.mkdir()
    (submit / ".venv").symlink_to(REPO / ".venv")
    script = out / "slurm" / "sweep.sbatch"
    for task in (0, 1):
        port = free_port()
        env = slurm_env(tmp_path, submit, task, RDZV_PORT=str(port))
        proc = subprocess.run(
            ["bash", str(script)], cwd=submit, env=env, capture_output=True, text=True, timeout=900
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "scored (" in proc.stdout
    again = subprocess.run(
        ["bash", str(script)],
        cwd=submit,
        env=slurm_env(tmp_path, submit, 0),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0 and "llama seed 1 is scored already" in again.stdout
    collected = sweep(spec, "--collect")
    assert collected.returncode == 0 and "2 of 2 cells have finished" in collected.stdout, (
        collected.stderr
    )
    arms = json.loads((out / "results.json").read_text())["tasks"]["playground/depo"]["arms"]
    for arm in ("llama", "llama_canon"):
        raw = raw_scores(out, arm, 1)
        assert arms[arm]["groups"]["all"]["mean"] == raw["overall"]["accuracy"]


# ----------------------------------------------------------------- report, text evaluations


def test_report_of_a_sweep_draws_its_cells_one_colour_per_arm(tmp_path):
    """``canon-titan report SWEEP_DIR``: every cell with curves, labelled by arm and seed; the seeds
    of an arm share its colour, and a cell that has not started is left out. The last logged loss
    is what ``[eval] kind = "loss"`` scores."""
    from PIL import Image

    from canon_titan.cli import main
    from canon_titan.evaluation.report import sweep_cells
    from canon_titan.sweep.scores import LossEval
    from test_report import write_run

    cells = []
    for arm, slope in (("llama", 0.3), ("llama_canon", 0.5)):
        for seed in (1, 2):
            folder = tmp_path / "cells" / arm / f"seed-{seed}"
            write_run(folder, "x", {s: 6 - slope * s - 0.01 * seed for s in range(1, 9)}, {}, 100)
            cells.append({"folder": str(folder), "task": "t", "arm": arm, "seed": seed})
    cells.append({"folder": str(tmp_path / "cells" / "later"), "task": "t", "arm": "D", "seed": 1})
    (tmp_path / "sweep.json").write_text(json.dumps({"spec": "s.toml", "cells": cells}))
    runs = sweep_cells(tmp_path)
    assert [r.label for r in runs] == [
        "llama seed 1",
        "llama seed 2",
        "llama_canon seed 1",
        "llama_canon seed 2",
    ]
    assert [r.colour_key for r in runs] == ["llama", "llama", "llama_canon", "llama_canon"]
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "curves.png")]) == 0
    image = np.asarray(Image.open(tmp_path / "curves.png").convert("RGB")).astype(int)
    for colour in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):  # two colours, one per arm
        assert (np.abs(image - colour).sum(-1) < 30).sum() > 100, colour
    assert (np.abs(image - (0x2C, 0xA0, 0x2C)).sum(-1) < 30).sum() < 20  # no third
    loss = LossEval().groups(tmp_path / "cells" / "llama_canon" / "seed-2")
    assert loss == {"loss": {"value": pytest.approx(6 - 0.5 * 8 - 0.02), "step": 8}}


def test_lm_eval_scores_are_read_as_accuracies_out_of_their_items(tmp_path):
    """``[eval] kind = "lm"``: each task's accuracy (acc, else exact_match, else acc_norm) out of
    the items lm-eval scored, which gives it a Wilson interval; a group's aggregate is left out."""
    from canon_titan.sweep.scores import LmEval

    record = {
        "results": {
            "hellaswag": {
                "alias": "hellaswag",
                "acc,none": 0.25,
                "acc_stderr,none": 0.1,
                "acc_norm,none": 0.3,
            },
            "tiny_gen": {"exact_match,none": 0.5},
            "canon_avg10": {"acc,none": 0.4},
        },
        "n-samples": {
            "hellaswag": {"original": 10042, "effective": 40},
            "tiny_gen": {"original": 6, "effective": 6},
        },
    }
    (tmp_path / "eval_lm.json").write_text(json.dumps(record))
    groups = LmEval(["hellaswag", "tiny_gen"], 40).groups(tmp_path)
    assert groups == {
        "hellaswag": {"value": 0.25, "correct": 10, "total": 40},
        "tiny_gen": {"value": 0.5, "correct": 3, "total": 6},
    }
    assert results.seed_cell(groups["hellaswag"], LmEval([], None)) == "25.0 (14-40)"


def test_every_shipped_spec_resolves_every_arm():
    """train_configs/sweeps/: each spec's arms resolve as config validate would (a typo in a spec
    fails here, not an hour into its sweep), with the budget its docs describe."""
    specs = sorted((REPO / "train_configs" / "sweeps").glob("*.toml"))
    assert {p.stem for p in specs} >= {"quickstart", "canon_placements", "linear_canon"}
    arms = {}
    for path in specs:
        spec = read_spec(path)
        arm_runs, budget = budgets.plan_sweep(spec)
        arms[path.stem] = [(a.arm.label, a.steps) for a in arm_runs]
        assert budget.kind == "tokens" and len(budgets.cells_of(spec, arm_runs)) == len(
            arm_runs
        ) * len(spec.seeds)
    assert arms["quickstart"] == [("llama", 300), ("llama_canon", 300)]
    assert [label for label, _ in arms["canon_placements"]] == ['""', "A", "B", "C", "D", "ABCD"]
    assert [label for label, _ in arms["linear_canon"]] == ['gla5 ""', "gla5 AbCD"]
