"""``canon-titan sweep``: a controlled comparison, every cell an ordinary training run."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from canon_titan.cli.common import fail
from canon_titan.sweep import budget as budgets
from canon_titan.sweep import guard, local, plots, results, slurm
from canon_titan.sweep.cells import write_sweep_file
from canon_titan.sweep.scores import evaluation_of
from canon_titan.sweep.spec import SweepError, read_spec
from canon_titan.tools.fileio import write_atomic


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="canon-titan sweep",
        description="Train every cell of a spec (base configs x axes x seeds) with a matched "
        "budget, score them, and write the table of means, intervals and verdicts "
        "(docs/experiments.md).",
    )
    parser.add_argument("spec", help="the sweep's TOML (train_configs/sweeps/)")
    parser.add_argument("--out", type=Path, help="its folder (default: [sweep] out)")
    parser.add_argument(
        "--jobs", type=int, help="cells trained side by side here (default: cores // nproc)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--dry-run", action="store_true", help="print the budget and the cells; train nothing"
    )
    mode.add_argument(
        "--slurm",
        action="store_true",
        help="write a manifest and an sbatch --array script (one cell a task) "
        "instead of training here",
    )
    mode.add_argument(
        "--collect", action="store_true", help="only gather the cells that have finished"
    )
    parser.add_argument(
        "--check",
        type=guard.parse_check,
        metavar="WINNER>LOSER:GROUP:POINTS",
        help="exit 1 unless arm WINNER beats arm LOSER on GROUP by POINTS "
        "(percentage points for accuracies) in every base config",
    )
    args = parser.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        parser.error("--jobs must be >= 1")
    try:
        return _sweep(args)
    except SweepError as e:
        return fail("sweep", e)
    except local.RunFailed as e:
        return fail("sweep", f"{e}; the same command continues the sweep")


def _sweep(args) -> int:
    spec = read_spec(args.spec)
    if args.out:
        spec.out = args.out
    # cells made by --slurm are collected at its world size (a global batch may depend on it)
    on_slurm = args.slurm or (args.collect and slurm.manifest_of(spec).is_file())
    arm_runs, budget = budgets.plan_sweep(spec, slurm=on_slurm)
    evaluation = evaluation_of(spec, synthetic=all(a.run.task is not None for a in arm_runs))
    cells = budgets.cells_of(spec, arm_runs)
    print(budgets.budget_table(arm_runs, budget), flush=True)
    if args.check:
        guard.check_names(args.check, arm_runs, evaluation, spec)
    for cell in cells:
        cell.check_folder()
    if args.dry_run:
        for cell in cells:
            state = "to train"
            if evaluation.read_scores(cell.folder):
                state = "scored"
            elif cell.trained_step():
                state = "trained"
            print(f"[sweep] {cell.name}: {cell.steps:,} steps, {state} ({cell.folder})")
        return 0
    write_sweep_file(spec, cells)
    if args.slurm:
        script = slurm.write(spec, cells, evaluation)
        again = f" --out {spec.out}" if args.out else ""
        print(
            f"[sweep] {len(cells)} cells, one array task each: {slurm.manifest_of(spec)}"
            f"\n[sweep] submit from {os.getcwd()}: sbatch {script}"
            f"\n[sweep] then: canon-titan sweep {spec.path} --collect{again}"
        )
        return 0
    if args.collect:
        scores = [evaluation.read_scores(cell.folder) for cell in cells]
        print(f"[sweep] {sum(s is not None for s in scores)} of {len(cells)} cells have finished")
    else:
        jobs = args.jobs or local.default_jobs(len(cells), spec.nproc)
        print(
            f"[sweep] {len(cells)} cells, {jobs} at a time, {spec.nproc} process(es) each",
            flush=True,
        )
        note = local.load_note(jobs, spec.nproc)
        if note:
            print(f"[sweep] {note}", flush=True)
        scores = local.run_local(cells, evaluation, jobs)
    scored = {
        (c.task.label, c.arm.label, c.seed): s
        for c, s in zip(cells, scores, strict=True)
        if s is not None
    }
    tasks = results.collect(arm_runs, scored, evaluation)
    report = results.markdown(tasks, budget, evaluation, spec.seeds)
    table = results.as_json(tasks, budget, evaluation, str(spec.path))
    write_atomic(spec.out / "results.md", report)
    write_atomic(spec.out / "results.json", json.dumps(table, indent=2) + "\n")
    figures = plots.draw(table, spec.out) if any(s is not None for s in scores) else []
    print("\n" + report)
    print(
        f"[sweep] {spec.out / 'results.md'}, {spec.out / 'results.json'}"
        + "".join(f", {path}" for path in figures)
    )
    if args.check:
        failed = guard.failures(args.check, tasks, evaluation)
        if failed:
            print("[sweep] check failed: " + "; ".join(failed), file=sys.stderr)
            return 1
    return 0
