"""How long ``canon-titan plan`` takes, and how much memory, on this machine: each case as a whole
command (start-up included), its wall time and peak resident memory. The target is an 8B recipe
at 512 GPUs in under 60 s and 4 GB on a 2-core CPU.

    .venv/bin/python scripts/benchmarks/bench_plan.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CASES = [
    (
        "LlamaCanon-8B, 512 x H200 (FSDP 512)",
        ["train_configs/LlamaCanon-8B-Nemo-1T-lr0.003.toml", "--gpus", "512", "--gpu", "h200"],
    ),
    (
        "GDN2Canon-8B, 512 x H200 (FSDP 512)",
        ["train_configs/GDN2Canon-8B-Nemo-1T-lr0.003.toml", "--gpus", "512", "--gpu", "h200"],
    ),
    (
        "LlamaCanon-8B, 512 x H200, TP 8",
        [
            "train_configs/LlamaCanon-8B-Nemo-1T-lr0.003.toml",
            "--gpus",
            "512",
            "--gpu",
            "h200",
            "--parallelism.tensor_parallel_degree",
            "8",
        ],
    ),
]


def run(args: list[str]) -> tuple[float, float]:
    """Wall seconds and peak resident GiB of one ``canon-titan plan`` process."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "canon_titan.cli", "plan", *args, "--json"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak resident set
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"plan {' '.join(args)} failed: {proc.stderr.read()[-2000:]}")
    return seconds, usage.ru_maxrss / 2**20  # KiB -> GiB


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"| case | wall s (median of {args.repeat}) | min | max | peak memory GiB |")
    print("|---|---:|---:|---:|---:|")
    for label, case in CASES:
        runs = [run(case) for _ in range(args.repeat)]
        walls = [w for w, _ in runs]
        print(
            f"| {label} | {statistics.median(walls):.1f} | {min(walls):.1f} | {max(walls):.1f} | "
            f"{max(m for _, m in runs):.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
