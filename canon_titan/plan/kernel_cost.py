"""What a GPU spends on each Triton kernel launch of a custom-op call, from the compiled kernels'
counts (``kernel_counts``: each launch's SASS by class, its programs, bytes and MMA FLOPs, read on a
CPU). A launch's time is the longest of three bounds (``priced``):

- memory: its tensor arguments' bytes, each once, at ``Assumptions.memory`` of the HBM bandwidth;
- issue: the busiest scheduler's cycles (its SM's share of the programs, their warps' instructions):
  every instruction takes an issue cycle and each pipe the cycles its instructions hold it
  (``PIPES``:
  integer and conversions at half rate, MUFU at an eighth), the larger; at the SM clock, with
  ``Assumptions.issue`` of those cycles issuing;
- tensor cores: its MMA instructions' FLOPs at ``Assumptions.tensor`` of the dense bf16 peak;

and no less than ``MIN_KERNEL_S``. An autotuned launch takes its fastest configuration by this
measure
(its autotuner times them all). What it cannot see: caches (a launch's re-reads of its own tensors
count once), the latency a program waits for when few warps share a scheduler (occupancy) or at a
barrier, branches inside straight code (both sides counted), and the host. The assumptions are held
to what GPU leases measured in docs/benchmarks/kernels.md (``scripts/benchmarks/kernel_cost.py
leases``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from canon_titan.plan import kernel_counts
from canon_titan.plan.gpus import GPU
from canon_titan.plan.kernel_counts import LaunchCount

MIN_KERNEL_S = 3e-6
"""The shortest a kernel launch takes on the GPU (``estimate.MIN_KERNEL_S``)."""


@dataclass(frozen=True)
class Assumptions:
    """What the bounds take a GPU to reach with a Triton kernel: shares of its HBM bandwidth, of its
    schedulers' issue cycles and of its tensor cores' dense bf16 peak."""

    memory: float
    issue: float
    tensor: float


ASSUMPTIONS = {
    # Memory: streaming kernels' share of the HBM bandwidth (``estimate.EFFICIENCY["memory"]``).
    # Issue: the share of the scheduler cycles the Canon backward kernels issued on, fitted to one
    # lease's timing of them alone (its block sweep, docs/benchmarks/kernels.md) and held to the
    # others'. Tensor: the share of the peak a training step's GEMMs reach
    # (``estimate.EFFICIENCY["matmul"]``), for the recurrences' smaller tiles at most that.
    "H100 SXM 80GB": Assumptions(memory=0.80, issue=0.61, tensor=0.70),
    "H200 SXM 141GB": Assumptions(memory=0.80, issue=0.61, tensor=0.70),
}
"""Per GPU of ``gpus.GPUS`` (by name) that the instrument prices: the sm_90 parts. Another GPU of
compute capability 9.0 (a GPU file) takes the H100's."""

PIPES = {
    # class: (pipe, cycles a warp instruction holds it on a scheduler). sm_90: 32 fp32 lanes, 16
    # integer lanes and 4 special-function lanes per scheduler (CUDA C++ Programming Guide,
    # "Arithmetic Instructions": 128, 64 and 16 results per clock per SM at compute capability 9.0);
    # conversions to and from 16-bit types taken as integer-rate.
    "fp32": ("fma", 1),
    "fp16": ("fma", 1),
    "int": ("alu", 2),
    "convert": ("alu", 2),
    "mufu": ("xu", 8),
}
"""The pipes an instruction class occupies beyond its issue cycle (others: the issue cycle only)."""
SCHEDULERS_PER_SM = 4


@dataclass
class LaunchCost:
    """A launch's count with its bounds on a GPU."""

    count: LaunchCount
    memory_s: float
    issue_s: float
    tensor_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.issue_s, self.tensor_s, MIN_KERNEL_S)

    @property
    def bound(self) -> str:
        return max(
            (("memory", self.memory_s), ("issue", self.issue_s), ("tensor", self.tensor_s)),
            key=lambda b: b[1],
        )[0]


def assumptions(gpu: GPU) -> Assumptions | None:
    """The GPU's, if the instrument prices it (sm_90 with its SM count and clock known)."""
    if gpu.capability != (9, 0) or not gpu.sm_count or not gpu.sm_clock_ghz:
        return None
    return ASSUMPTIONS.get(gpu.name, ASSUMPTIONS["H100 SXM 80GB"])


def scheduler_cycles(executed: dict[str, float], programs: int, num_warps: int, sms: int) -> float:
    """The busiest scheduler's cycles: its SM's share of the programs (the launch's waves, rounded
    up), their warps spread over the SM's schedulers, each warp's average instructions taking the
    larger of their issue cycles and their busiest pipe's cycles."""
    if not programs:
        return 0.0
    warps = programs * num_warps
    issue = sum(executed.values()) / warps
    pipes: dict[str, float] = {}
    for cls, n in executed.items():
        if cls in PIPES:
            pipe, cycles = PIPES[cls]
            pipes[pipe] = pipes.get(pipe, 0.0) + n * cycles / warps
    per_warp = max(issue, *pipes.values()) if pipes else issue
    warps_per_scheduler = math.ceil(math.ceil(programs / sms) * num_warps / SCHEDULERS_PER_SM)
    return warps_per_scheduler * per_warp


def priced(count: LaunchCount, gpu: GPU, given: Assumptions) -> LaunchCost:
    """``count``'s bounds on ``gpu``."""
    cycles = scheduler_cycles(count.executed, count.programs, count.num_warps, gpu.sm_count)
    return LaunchCost(
        count,
        count.bytes / (gpu.hbm_tb_s * 1e12 * given.memory),
        cycles / (gpu.sm_clock_ghz * 1e9 * given.issue),
        count.mma_flops / (gpu.bf16_tflops * 1e12 * given.tensor),
    )


class InstrumentError(RuntimeError):
    """The instrument could not count a call here (no Triton compiler, a kernel it cannot read)."""


def count_elsewhere(calls: list[tuple[str, list]], folder: Path, timeout_s: float = 3600) -> None:
    """Count ``calls`` in a process of the real Triton (``kernel_counts``'s main), into the
    cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    print(
        f"[kernel cost] compiling the kernels of {len(calls)} call(s) for sm_90 (kept in {folder})",
        file=sys.stderr,
        flush=True,
    )
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "canon_titan.plan.kernel_counts", str(folder)],
        input=json.dumps(calls),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode:
        raise InstrumentError(
            proc.stderr.strip().splitlines()[-1]
            if proc.stderr.strip()
            else f"the counting process ended with {proc.returncode}"
        )
    print(
        f"[kernel cost] done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True
    )


def best(counts: list[LaunchCount], gpu: GPU, given: Assumptions) -> LaunchCost:
    """The configuration an autotuner would pick by this measure: the fastest."""
    return min((priced(c, gpu, given) for c in counts), key=lambda c: c.seconds)


def call_seconds(calls: list[tuple[str, list]], gpu: GPU) -> dict[str, float] | None:
    """Seconds of each call (by ``kernel_counts.call_key``) on ``gpu``: its launches' times, each at
    its fastest configuration; None where the instrument does not price this GPU."""
    given = assumptions(gpu)
    if given is None:
        return None
    folder = kernel_counts.cache_folder()
    keyed = {kernel_counts.call_key(op, args): (op, args) for op, args in calls}
    missing = [call for key, call in keyed.items() if kernel_counts.cached(*call, folder) is None]
    if missing:
        count_elsewhere(missing, folder)
    out = {}
    for key, call in keyed.items():
        counts = kernel_counts.cached(*call, folder)
        if counts is None:
            raise InstrumentError(f"{call[0]}: not counted after the counting process ran")
        out[key] = sum(best(configs, gpu, given).seconds for configs in counts if configs)
    return out
