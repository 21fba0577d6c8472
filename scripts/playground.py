"""Canon vs no-Canon on the synthetic playground, sized for a CPU: a front of ``canon-titan sweep``.

For each task config in ``train_configs/playground/`` (default: depo and mano), trains ``llama``
and ``llama_canon`` debug models with identical budgets (same data, steps, batch and optimizer;
only ``[model] name`` differs; the config's seed), scores each checkpoint on the task's held-out
test set with greedy generation, and writes ``results.md`` (tables), ``results.json``,
``accuracy.png`` (accuracy per hop count / group, both models, with 95% intervals) and
``heatmap.png`` under ``--out``, as the sweep does; the sweep's spec is ``--out``/spec.toml.
Finished runs are reused, so an interrupted experiment continues where it stopped. Runs go side by
side (``--jobs``, by default as many as the machine has cores for at ``--nproc`` processes each).

``--check GROUP:POINTS`` (e.g. ``k=1:40``) turns the experiment into a guard: it exits 1 unless
llama_canon's accuracy on that group beats llama's by at least POINTS percentage points in every
task.

``--replot RESULTS.json`` draws ``accuracy.png`` under ``--out`` again from a results file (a
sweep's), without training.

  python scripts/playground.py [--tasks depo,mano] [--nproc 1] [--jobs N] [--steps N] [--count 100]
                               [--check k=1:40] [--out DIR]
  python scripts/playground.py --replot outputs/playground/results.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = ("llama", "llama_canon")


def parse_check(text: str) -> tuple[str, float]:
    group, _, points = text.rpartition(":")
    try:
        if group:
            return group, float(points)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected GROUP:POINTS such as k=1:40, got {text!r}")


def spec_text(tasks: list[str], args) -> str:
    configs = [str(REPO / "train_configs" / "playground" / f"{task}.toml") for task in tasks]
    seeds = [tomllib.loads(Path(configs[0]).read_text()).get("job", {}).get("seed", 777)]
    lines = [
        "# scripts/playground.py " + " ".join(sys.argv[1:]),
        "[sweep]",
        f"config = {json.dumps(configs)}",
        f"seeds = {seeds}",
        f"nproc = {args.nproc}",
        "",
        "[axes]",
        f'"model.name" = {json.dumps(list(MODELS))}',
        "",
        "[eval]",
        f"count = {args.count}",
        "",
    ]
    if args.steps:
        lines += ["[budget]", f"steps = {args.steps}", ""]
    return "\n".join(lines)


def replot(results_file: Path, out: Path) -> int:
    from canon_titan.sweep.plots import PlotError, accuracy_figure, check_results

    try:
        results = json.loads(results_file.read_text())
    except OSError as e:
        sys.exit(f"playground: --replot {results_file}: cannot be read ({e.strerror or e})")
    except ValueError as e:
        sys.exit(f"playground: --replot {results_file}: not JSON ({e})")
    try:
        check_results(results)
    except PlotError as e:
        sys.exit(f"playground: --replot {results_file}: {e}")
    accuracy_figure(results, out / "accuracy.png")
    print(f"[playground] {out}/accuracy.png")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks", default="depo,mano", help="configs in train_configs/playground/, comma-separated"
    )
    parser.add_argument("--nproc", type=int, default=1, help="training processes per run")
    parser.add_argument("--jobs", type=int, help="runs side by side (default: cores // nproc)")
    parser.add_argument("--steps", type=int, help="training steps (default: the config's)")
    parser.add_argument(
        "--count",
        type=int,
        default=100,
        help="test items per group (Brevo: 4x as many graphs, grouped by depth)",
    )
    parser.add_argument(
        "--check",
        type=parse_check,
        metavar="GROUP:POINTS",
        help="exit 1 unless llama_canon beats llama on GROUP by POINTS points in every task",
    )
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "playground")
    parser.add_argument(
        "--replot",
        type=Path,
        metavar="RESULTS.json",
        help="only draw accuracy.png from a results file",
    )
    args = parser.parse_args()
    if args.replot:
        return replot(args.replot, args.out.resolve())
    tasks = [t for t in args.tasks.split(",") if t]
    for task in tasks:
        if not (REPO / "train_configs" / "playground" / f"{task}.toml").is_file():
            parser.error(f"--tasks: no train_configs/playground/{task}.toml")
    from canon_titan.cli import main as canon_titan

    with tempfile.TemporaryDirectory(prefix="playground-") as folder:
        spec = Path(folder) / "playground.toml"
        spec.write_text(spec_text(tasks, args))
        argv = ["sweep", str(spec), "--out", str(args.out.resolve())]
        if args.jobs:
            argv += ["--jobs", str(args.jobs)]
        if args.check:
            argv += ["--check", f"llama_canon>llama:{args.check[0]}:{args.check[1]:g}"]
        return canon_titan(argv)


if __name__ == "__main__":
    sys.exit(main())
