"""Canon vs no-Canon on the synthetic playground, sized for a CPU.

For each task config in ``train_configs/playground/`` (default: depo and mano), trains ``llama``
and ``llama_canon`` debug models with identical budgets (same data, steps, batch and optimizer;
only ``[model] name`` differs), scores each checkpoint on the task's held-out test set with
greedy generation, and writes ``results.md`` (tables), ``results.json`` and ``accuracy.png``
(accuracy per hop count / group, both models) under ``--out``. Finished runs are reused, so an
interrupted experiment continues where it stopped.

  python scripts/playground.py [--tasks depo,mano] [--nproc 1] [--steps N] [--count 100] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from canon_titan.fileio import write_atomic

REPO = Path(__file__).resolve().parent.parent
MODELS = ("llama", "llama_canon")


def run(cmd: list[str], log: Path) -> None:
    print("+ " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            f.write(line)
            if any(mark in line for mark in ("progress:", "config error", "Traceback", "Error:")):
                print("  " + line.split(" - INFO - ")[-1].rstrip(), flush=True)
        if proc.wait():
            sys.exit(f"playground: command failed (exit {proc.returncode}); log: {log}")


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
    started = time.monotonic()
    run(cli + ["train", "--config", str(config), "--nproc", str(args.nproc), *overrides], out / "train.log")
    trained = time.monotonic() - started
    run(cli + ["eval", "synthetic", "--config", str(out / "run_config.toml"), "--count", str(args.count),
               "--out", str(result_file)], out / "eval.log")
    result = json.loads(result_file.read_text())
    result["train_seconds"] = round(trained, 1)
    result["steps"] = steps
    write_atomic(result_file, json.dumps(result, indent=2) + "\n")
    return result


def table(task: str, results: dict[str, dict]) -> str:
    groups = list(results[MODELS[0]]["groups"])
    lines = [f"### {task} ({results[MODELS[0]]['dataset']}, {results[MODELS[0]]['count']} items per group)", "",
             "| model | " + " | ".join(groups) + " | all | train s |",
             "|---|" + "---|" * (len(groups) + 2)]
    for model in MODELS:
        r = results[model]
        cells = [f"{100 * r['groups'][g]['accuracy']:.1f}" for g in groups]
        lines.append(f"| {model} | " + " | ".join(cells) + f" | {100 * r['overall']['accuracy']:.1f} | "
                     f"{r.get('train_seconds', '')} |")
    return "\n".join(lines)


def plot(all_results: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_results), figsize=(5 * len(all_results), 3.6), squeeze=False)
    for ax, (task, results) in zip(axes[0], all_results.items()):
        groups = list(results[MODELS[0]]["groups"])
        for model, marker in zip(MODELS, ("o", "s")):
            ax.plot(range(len(groups)), [100 * results[model]["groups"][g]["accuracy"] for g in groups],
                    marker=marker, label=model)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylim(-3, 103)
        ax.set_ylabel("greedy accuracy (%)")
        ax.set_title(f"{task}: {results[MODELS[0]]['dataset']}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=110, format="png")
    write_atomic(path, png.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="depo,mano", help="configs in train_configs/playground/, comma-separated")
    parser.add_argument("--nproc", type=int, default=1, help="training processes per run")
    parser.add_argument("--steps", type=int, help="training steps (default: the config's)")
    parser.add_argument("--count", type=int, default=100, help="test items per group")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "playground")
    args = parser.parse_args()
    args.out = args.out.resolve()
    tasks = [t for t in args.tasks.split(",") if t]
    for task in tasks:
        if not (REPO / "train_configs" / "playground" / f"{task}.toml").is_file():
            parser.error(f"--tasks: no train_configs/playground/{task}.toml")
    started = time.monotonic()
    all_results = {}
    for n, task in enumerate(tasks):
        all_results[task] = {}
        for m, model in enumerate(MODELS):
            done = n * len(MODELS) + m
            elapsed = time.monotonic() - started
            eta = f", ETA {elapsed / done * (len(tasks) * len(MODELS) - done) / 60:.1f} min" if done else ""
            print(f"[playground] run {done + 1}/{len(tasks) * len(MODELS)}: {task} / {model} "
                  f"(elapsed {elapsed / 60:.1f} min{eta})", flush=True)
            all_results[task][model] = train_and_score(task, model, args)
    report = "\n\n".join(table(task, results) for task, results in all_results.items()) + "\n"
    write_atomic(args.out / "results.md", report)
    write_atomic(args.out / "results.json", json.dumps(all_results, indent=2) + "\n")
    plot(all_results, args.out / "accuracy.png")
    print("\n" + report)
    print(f"[playground] done in {(time.monotonic() - started) / 60:.1f} min: {args.out}/results.md, "
          f"{args.out}/accuracy.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
