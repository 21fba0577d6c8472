#!/usr/bin/env python
"""Start-up time of the CLI: ``canon-titan --help`` and ``canon-titan config validate`` on the
debug configs, each run as a fresh process (imports included), against the 5-s target.

  .venv/bin/python scripts/benchmarks/bench_startup.py            # 5 runs of each, median and min
  .venv/bin/python scripts/benchmarks/bench_startup.py --runs 9
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET_S = 5.0


def timed(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "canon_titan.cli", *argv], cwd=REPO, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if proc.returncode != 0:
            sys.exit(f"bench_startup: `canon-titan {' '.join(argv)}` failed (exit {proc.returncode}):\n{proc.stderr}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    configs = [str(p.relative_to(REPO)) for p in sorted((REPO / "train_configs").glob("*debug.toml"))]
    commands = {"--help": ["--help"], f"config validate ({len(configs)} debug configs)": ["config", "validate", *configs]}
    print(f"{'command':<40} {'median s':>9} {'min s':>7}  target < {TARGET_S:.0f} s")
    for name, argv in commands.items():
        times = timed(argv, args.runs)
        median = statistics.median(times)
        print(f"{name:<40} {median:>9.2f} {min(times):>7.2f}  {'ok' if median < TARGET_S else 'OVER'}", flush=True)


if __name__ == "__main__":
    main()
