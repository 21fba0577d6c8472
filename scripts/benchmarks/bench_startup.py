#!/usr/bin/env python
"""Start-up time of the CLI: ``canon-titan --help`` and ``canon-titan config validate`` on the
debug configs, each run as a fresh process (imports included), against the 5-s target; and a whole
2-rank training job of two steps on the LlamaCanon debug config (``canon-titan train --nproc 2``:
the launcher, torchrun and both ranks, from start to exit), whose time is mostly its processes
starting and ending. Wall time and the CPU time of all its processes.

  .venv/bin/python scripts/benchmarks/bench_startup.py            # 5 runs of each, median and min
  .venv/bin/python scripts/benchmarks/bench_startup.py --runs 9
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET_S = 5.0


def timed(argv: list[str], runs: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds (user + system, of the command and every process it started) of each
    run."""
    walls, cpus = [], []
    for _ in range(runs):
        if "--job.dump_folder" in argv:  # each run a new one (a finished run is not trained again)
            shutil.rmtree(argv[argv.index("--job.dump_folder") + 1], ignore_errors=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "canon_titan.cli", *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline"),
        )
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        if proc.returncode != 0:
            sys.exit(
                f"bench_startup: `canon-titan {' '.join(argv)}` failed (exit "
                f"{proc.returncode}):\n{proc.stderr}"
            )
    return walls, cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    configs = [
        str(p.relative_to(REPO)) for p in sorted((REPO / "train_configs").glob("*debug.toml"))
    ]
    dump = Path(tempfile.mkdtemp(prefix="bench_startup_")) / "run"
    commands = {
        "--help": (["--help"], TARGET_S),
        f"config validate ({len(configs)} debug configs)": (
            ["config", "validate", *configs],
            TARGET_S,
        ),
        "train, 2 ranks, 2 steps (llama_canon debug)": (
            [
                "train",
                "--config",
                "train_configs/llama_canon_debug.toml",
                "--nproc",
                "2",
                "--training.steps",
                "2",
                "--training.seq_len",
                "128",
                "--job.dump_folder",
                str(dump),
            ],
            None,
        ),
    }
    print(f"{'command':<45} {'median s':>9} {'min s':>7} {'CPU s':>7}  target")
    for name, (argv, target) in commands.items():
        walls, cpus = timed(argv, args.runs)
        median = statistics.median(walls)
        verdict = (
            "-" if target is None else f"< {target:.0f} s: {'ok' if median < target else 'OVER'}"
        )
        print(
            f"{name:<45} {median:>9.2f} {min(walls):>7.2f} {statistics.median(cpus):>7.2f} "
            f" {verdict}",
            flush=True,
        )
    shutil.rmtree(dump.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
