"""Canon vs no-Canon on the synthetic playground, sized for a CPU.

For each task config in ``train_configs/playground/`` (default: depo and mano), trains ``llama``
and ``llama_canon`` debug models with identical budgets (same data, steps, batch and optimizer;
only ``[model] name`` differs), scores each checkpoint on the task's held-out test set with
greedy generation, and writes ``results.md`` (tables), ``results.json`` and ``accuracy.png``
(accuracy per hop count / group, both models) under ``--out``. Finished runs are reused, so an
interrupted experiment continues where it stopped. Runs go side by side (``--jobs``, by default as
many as the machine has cores for at ``--nproc`` processes each): on a 2-core CPU the two models of a
task train at once, one single-threaded process each, which is faster than one after the other on
two processes each (FSDP over gloo costs more than it splits).

``--check GROUP:POINTS`` (e.g. ``k=1:40``) turns the experiment into a guard: it exits 1 unless
llama_canon's accuracy on that group beats llama's by at least POINTS percentage points in every task.

``--replot RESULTS.json`` draws ``accuracy.png`` under ``--out`` again from a results file, without training.

  python scripts/playground.py [--tasks depo,mano] [--nproc 1] [--jobs N] [--steps N] [--count 100]
                               [--check k=1:40] [--out DIR]
  python scripts/playground.py --replot outputs/playground/results.json --out DIR
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import NormalDist

from canon_titan.launch.ownership import torchrun_preexec
from canon_titan.tools.fileio import write_atomic

REPO = Path(__file__).resolve().parent.parent
MODELS = ("llama", "llama_canon")


class RunFailed(Exception):
    pass


def run(cmd: list[str], log: Path, name: str) -> None:
    print(f"[{name}] + " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        # preexec: SIGTERM the run when this process ends, however it ends (its runs save and stop, none is orphaned)
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=torchrun_preexec)
        for line in proc.stdout:
            f.write(line)
            if any(mark in line for mark in ("progress:", "config error", "Traceback", "Error:")):
                print(f"  [{name}] " + line.split(" - INFO - ")[-1].rstrip(), flush=True)
        if proc.wait():
            raise RunFailed(f"playground: {name}: command failed (exit {proc.returncode}); log: {log}")


def train_and_score(task: str, model: str, args) -> dict:
    out = args.out / task / model
    result_file = out / "eval.json"
    config = REPO / "train_configs" / "playground" / f"{task}.toml"
    with open(config, "rb") as f:
        steps = args.steps or tomllib.load(f)["training"]["steps"]
    if result_file.is_file():
        previous = json.loads(result_file.read_text())
        if previous.get("steps") == steps and previous.get("count") == args.count:
            print(f"[playground] {task}/{model}: reusing {result_file}")
            return previous
        print(f"[playground] {task}/{model}: {result_file} is for another budget or test size; redoing it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = ["--model.name", model, "--job.dump_folder", str(out)]
    if args.steps:
        overrides += ["--training.steps", str(args.steps), "--checkpoint.interval", str(args.steps)]
    cli = [sys.executable, "-m", "canon_titan.cli"]
    name = f"{task}/{model}"
    started = time.monotonic()
    run(cli + ["train", "--config", str(config), "--nproc", str(args.nproc), *overrides], out / "train.log", name)
    trained = time.monotonic() - started
    run(cli + ["eval", "synthetic", "--config", str(out / "run_config.toml"), "--count", str(args.count),
               "--out", str(result_file)], out / "eval.log", name)
    result = json.loads(result_file.read_text())
    result["train_seconds"] = round(trained, 1)
    result["steps"] = steps
    write_atomic(result_file, json.dumps(result, indent=2) + "\n")
    return result


def wilson_interval(accuracy: float, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (stays inside [0, 1], unlike the normal one at 0% or 100%)."""
    z = NormalDist().inv_cdf(0.975)
    centre = (accuracy + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def cell(group: dict) -> str:
    low, high = wilson_interval(group["accuracy"], group["total"])
    return f"{100 * group['accuracy']:.1f} ({100 * low:.0f}-{100 * high:.0f})"


def table(task: str, results: dict[str, dict]) -> str:
    groups = list(results[MODELS[0]]["groups"])
    lines = [f"### {task} ({results[MODELS[0]]['dataset']}, {results[MODELS[0]]['count']} items per group; "
             "accuracy % with its 95% interval)", "",
             "| model | " + " | ".join(groups) + " | all | train s |",
             "|---|" + "---|" * (len(groups) + 2)]
    for model in MODELS:
        r = results[model]
        cells = [cell(r["groups"][g]) for g in groups]
        lines.append(f"| {model} | " + " | ".join(cells) + f" | {100 * r['overall']['accuracy']:.1f} | "
                     f"{r.get('train_seconds', '')} |")
    return "\n".join(lines)


def plot(all_results: dict[str, dict[str, dict]], path: Path) -> None:
    """One panel per task: a bar per group and model, with its 95% Wilson interval, so that a
    reader sees at a glance which differences the test set can tell apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_results), figsize=(4.6 * len(all_results), 3.8), squeeze=False)
    width = 0.8 / len(MODELS)
    for ax, (task, results) in zip(axes[0], all_results.items()):
        groups = list(results[MODELS[0]]["groups"])
        for i, (model, colour) in enumerate(zip(MODELS, ("#8c8c8c", "#1f77b4"))):
            cells = [results[model]["groups"][g] for g in groups]
            heights = [100 * c["accuracy"] for c in cells]
            intervals = [wilson_interval(c["accuracy"], c["total"]) for c in cells]
            below = [h - 100 * low for h, (low, _) in zip(heights, intervals)]
            above = [100 * high - h for h, (_, high) in zip(heights, intervals)]
            xs = [g + (i - (len(MODELS) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, heights, width, yerr=[below, above], capsize=3, color=colour, label=model)
            for x, h, (_, high) in zip(xs, heights, intervals):
                ax.annotate(f"{h:.0f}", (x, 100 * high), xytext=(0, 3), textcoords="offset points", ha="center",
                            va="bottom", fontsize=7)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylim(0, 110)
        ax.set_ylabel("greedy accuracy (%), 95% interval")
        ax.set_title(f"{task}\n{results[MODELS[0]]['dataset']}, {results[MODELS[0]]['count']} per group", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=110, format="png")
    write_atomic(path, png.getvalue())


def parse_check(text: str) -> tuple[str, float]:
    group, _, points = text.rpartition(":")
    try:
        if group:
            return group, float(points)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected GROUP:POINTS such as k=1:40, got {text!r}")


def held_out_groups(task: str, count: int) -> list[str]:
    """The groups a task's held-out test set scores (what ``--check`` can name), known before training."""
    from canon_titan.config import load
    from canon_titan.evaluation.synthetic import DEFAULT_TEST_SEED, task_of

    items = task_of(load(REPO / "train_configs" / "playground" / f"{task}.toml", environment=False)).test_items(
        DEFAULT_TEST_SEED, count)
    return list(dict.fromkeys(item.group for item in items))


def check(all_results: dict[str, dict[str, dict]], group: str, points: float) -> list[str]:
    """The tasks where llama_canon does not beat llama on ``group`` by ``points`` percentage points."""
    failures = []
    for task, results in all_results.items():
        accuracy = {}
        for model in MODELS:
            if group not in results[model]["groups"]:
                failures.append(f"{task}: no group {group!r} (groups: {', '.join(results[model]['groups'])})")
                break
            accuracy[model] = 100 * results[model]["groups"][group]["accuracy"]
        else:
            margin = accuracy["llama_canon"] - accuracy["llama"]
            verdict = "ok" if margin >= points else "FAILED"
            print(f"[playground] check {task} {group}: llama_canon {accuracy['llama_canon']:.1f} - llama "
                  f"{accuracy['llama']:.1f} = {margin:+.1f} points (need >= {points:g}): {verdict}")
            if margin < points:
                failures.append(f"{task}: llama_canon beats llama on {group} by {margin:+.1f} points, "
                                f"not the {points:g} required")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="depo,mano", help="configs in train_configs/playground/, comma-separated")
    parser.add_argument("--nproc", type=int, default=1, help="training processes per run")
    parser.add_argument("--jobs", type=int, help="runs side by side (default: cores // nproc)")
    parser.add_argument("--steps", type=int, help="training steps (default: the config's)")
    parser.add_argument("--count", type=int, default=100, help="test items per group")
    parser.add_argument("--check", type=parse_check, metavar="GROUP:POINTS",
                        help="exit 1 unless llama_canon beats llama on GROUP by POINTS points in every task")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "playground")
    parser.add_argument("--replot", type=Path, metavar="RESULTS.json", help="only draw accuracy.png from a results file")
    args = parser.parse_args()
    args.out = args.out.resolve()
    if args.replot:
        try:
            plot(json.loads(args.replot.read_text()), args.out / "accuracy.png")
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--replot {args.replot}: not a playground results file ({type(e).__name__}: {e})")
        print(f"[playground] {args.out}/accuracy.png")
        return 0
    tasks = [t for t in args.tasks.split(",") if t]
    for task in tasks:
        if not (REPO / "train_configs" / "playground" / f"{task}.toml").is_file():
            parser.error(f"--tasks: no train_configs/playground/{task}.toml")
    if args.check:  # a typo must not cost the whole experiment
        for task in tasks:
            groups = held_out_groups(task, args.count)
            if args.check[0] not in groups:
                parser.error(f"--check {args.check[0]}:{args.check[1]:g}: {task} has no group {args.check[0]!r}; "
                             f"its groups: {', '.join(groups)}")
    runs = [(task, model) for task in tasks for model in MODELS]
    jobs = args.jobs or max(1, min(len(runs), (os.cpu_count() or 1) // args.nproc))
    print(f"[playground] {len(runs)} runs, {jobs} at a time, {args.nproc} process(es) each", flush=True)
    started = time.monotonic()
    finished = 0

    def one(run_key: tuple[str, str]) -> dict:
        nonlocal finished
        result = train_and_score(*run_key, args)
        finished += 1
        elapsed = time.monotonic() - started
        eta = elapsed / finished * (len(runs) - finished) if finished % jobs == 0 else None
        print(f"[playground] finished {finished}/{len(runs)}: {'/'.join(run_key)} (elapsed {elapsed / 60:.1f} min"
              + (f", ETA {eta / 60:.1f} min)" if eta is not None and finished < len(runs) else ")"), flush=True)
        return result

    with ThreadPoolExecutor(jobs) as pool:
        try:
            results = list(pool.map(one, runs))
        except RunFailed as failure:
            sys.exit(str(failure))
    all_results = {task: {} for task in tasks}
    for (task, model), result in zip(runs, results):
        all_results[task][model] = result
    report = "\n\n".join(table(task, results) for task, results in all_results.items()) + "\n"
    write_atomic(args.out / "results.md", report)
    write_atomic(args.out / "results.json", json.dumps(all_results, indent=2) + "\n")
    plot(all_results, args.out / "accuracy.png")
    print("\n" + report)
    print(f"[playground] done in {(time.monotonic() - started) / 60:.1f} min: {args.out}/results.md, "
          f"{args.out}/accuracy.png")
    if args.check:
        failures = check(all_results, *args.check)
        if failures:
            print("[playground] check failed: " + "; ".join(failures), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
