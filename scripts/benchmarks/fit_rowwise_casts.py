"""Where the planner's cost of torchao's row-wise float8 casts comes from
(``canon_titan.plan.recorder. ROWWISE_CAST_BYTES``), and how well the plan meets its source with it.

    .venv/bin/python scripts/benchmarks/fit_rowwise_casts.py [--fit] [--min-m 8192]

The source is torchao's published microbenchmark (pytorch/ao#2312,
``pytorch/ao/docs/static/fp8-rowwise-perf.png``, June 2025, PyTorch 2.8.0a0 on an H100): the
speed-up of a compiled LayerNorm -> Linear -> Sigmoid forward and backward with torchao's
``rowwise`` float8 recipe over the same in bf16, by the forward's M (tokens), K (in features) and N
(out features). ``TABLE`` holds its rows of M >= 8192 (training's token counts; below them, launch
overheads the plan does not model dominate), as published.

The table's rows alternate between two halves (``rows``): the constants are fitted to one and
tested on the other. Without ``--fit``: plans the module for every row (the plan's recorder on fake
tensors, the whole module compiled, an H100 SXM) and prints the planned speed-up beside the measured
one, with each half's median and worst error. With ``--fit``: plans the fitted half with the casts'
extra cost at zero, fits the missing time as ``a * M * K + b * M * N`` (least squares, relative),
and prints ``a`` and ``b`` in bytes per element at the plan's streaming bandwidth: the constants'
derivation.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

N_COLUMNS = (1024, 2048, 4096, 8192, 16384, 32768)
TABLE = {
    # M: {K: speed-ups for N in N_COLUMNS}
    8192: {
        1024: (0.48, 0.52, 0.65, 0.77, 0.83, 0.84),
        2048: (0.45, 0.64, 0.82, 1.01, 1.03, 1.06),
        4096: (0.52, 0.76, 1.00, 1.13, 1.17, 1.19),
        8192: (0.59, 0.85, 1.05, 1.20, 1.31, 1.41),
        16384: (0.58, 0.82, 1.03, 1.22, 1.37, 1.40),
        32768: (0.59, 0.82, 1.04, 1.30, 1.36, 1.46),
    },
    16384: {
        1024: (0.48, 0.58, 0.73, 0.86, 0.85, 0.89),
        2048: (0.51, 0.70, 0.90, 1.05, 1.07, 1.15),
        4096: (0.57, 0.79, 1.02, 1.20, 1.26, 1.40),
        8192: (0.61, 0.87, 1.08, 1.33, 1.39, 1.49),
        16384: (0.59, 0.83, 1.07, 1.34, 1.42, 1.55),
        32768: (0.60, 0.85, 1.16, 1.35, 1.48, 1.72),
    },
    32768: {
        1024: (0.51, 0.62, 0.77, 0.87, 0.88, 0.94),
        2048: (0.54, 0.73, 0.91, 1.08, 1.14, 1.27),
        4096: (0.59, 0.81, 1.04, 1.28, 1.35, 1.49),
        8192: (0.63, 0.87, 1.11, 1.41, 1.50, 1.62),
        16384: (0.60, 0.83, 1.16, 1.39, 1.49, 1.73),
        32768: (0.63, 0.93, 1.16, 1.48, 1.70, 1.52),
    },
}
"""torchao's row-wise float8 speed-up over bf16 (its table, H100, PyTorch 2.8.0a0)."""


HALVES = ("fit", "held_out")


def rows(min_m: int = 0, half: str | None = None):
    """The table's (M, K, N, speed-up) from ``min_m``; ``half``: only the rows the constants are
    fitted to (``fit``) or only the others (``held_out``), alternating as the squares of a
    chessboard along each of M, K and N, so that each half spans the whole table."""
    for i, (m, by_k) in enumerate(TABLE.items()):
        if m < min_m:
            continue
        for j, (k, speedups) in enumerate(by_k.items()):
            for c, (n, speedup) in enumerate(zip(N_COLUMNS, speedups)):
                if half is None or HALVES[(i + j + c) % 2] == half:
                    yield m, k, n, speedup


def record_module(recipe: str, m: int, k: int, n: int):
    """The plan's trace of the benchmark's module (LayerNorm without affine -> Linear without bias
    -> Sigmoid, bf16), forward and backward through the sum of its output, on fake tensors; the
    linear converted to torchao's float8 training linear with ``recipe`` (emulated, as the plan
    runs it) unless ``recipe`` is ``bf16``."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from canon_titan.plan.recorder import StepRecorder

    with FakeTensorMode():
        norm = torch.nn.LayerNorm(k, elementwise_affine=False, dtype=torch.bfloat16)
        linear = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16))
        if recipe != "bf16":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
            convert_to_float8_training(linear, config=config)
        x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
        recorder = StepRecorder()
        with recorder:
            h = norm(x)
            if recipe != "bf16":
                recorder.enter_fp8_linear()
            y = linear(h)
            if recipe != "bf16":
                recorder.exit_fp8_linear()
            torch.sigmoid(y).sum().backward()
    return recorder.trace


def module_seconds(trace, gpu_name: str = "h100", compiled: bool = True) -> dict[str, float]:
    """The plan's seconds per op kind for a recorded module (all of it compiled, as the benchmark
    ran)."""
    from canon_titan.plan.estimate import compute_seconds
    from canon_titan.plan.fake_world import RankStep
    from canon_titan.plan.gpus import GPUS

    step = RankStep(0, trace, {}, {}, {}, accumulation=1, groups_run=1, tokens_per_group=1)
    seconds, _, _ = compute_seconds(step, GPUS[gpu_name], compiled=compiled)
    return seconds


def planned_speedup(m: int, k: int, n: int, recipe: str = "rowwise") -> float:
    bf16 = sum(module_seconds(record_module("bf16", m, k, n)).values())
    return bf16 / sum(module_seconds(record_module(recipe, m, k, n)).values())


def fit(min_m: int) -> dict[str, float]:
    """Least-squares ``a``, ``b`` (seconds per element) of the time the plan misses with no extra
    cast cost, weighted by the measured float8 time (relative errors), over the table's ``fit`` half
    (the other half is what the constants are tested on)."""
    import numpy as np

    from canon_titan.plan import recorder

    saved = dict(recorder.ROWWISE_CAST_BYTES)
    recorder.ROWWISE_CAST_BYTES.update({role: 0.0 for role in saved})
    try:
        data = []
        for m, k, n, speedup in rows(min_m, "fit"):
            bf16 = sum(module_seconds(record_module("bf16", m, k, n)).values())
            planned = sum(module_seconds(record_module("rowwise", m, k, n)).values())
            data.append((m * k, m * n, bf16 / speedup, planned))
    finally:
        recorder.ROWWISE_CAST_BYTES.update(saved)
    mk, mn, measured, planned = (np.array(c, dtype=float) for c in zip(*data))
    weights = 1 / measured
    design = np.stack([mk, mn], 1) * weights[:, None]
    (a, b), *_ = np.linalg.lstsq(design, (measured - planned) * weights, rcond=None)
    errors = np.abs((planned + a * mk + b * mn) / measured - 1)
    return {
        "a": float(a),
        "b": float(b),
        "median": float(np.median(errors)),
        "worst": float(errors.max()),
        "unfitted_median": float(np.median(np.abs(planned / measured - 1))),
        "unfitted_worst": float(np.abs(planned / measured - 1).max()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--fit", action="store_true", help="derive the constants instead of checking them"
    )
    parser.add_argument(
        "--min-m", type=int, default=8192, help="the table's rows from this M (default 8192)"
    )
    args = parser.parse_args()
    from canon_titan.plan.estimate import EFFICIENCY
    from canon_titan.plan.gpus import GPUS

    if args.fit:
        result = fit(args.min_m)
        bandwidth = GPUS["h100"].hbm_tb_s * 1e12 * EFFICIENCY["memory"]
        print(
            f"without the casts' extra cost: median error {100 * result['unfitted_median']:.1f}%, "
            f"worst {100 * result['unfitted_worst']:.0f}%"
        )
        print(
            f"a = {result['a'] * 1e12:.2f} ps per element of the input (M x K): "
            f"{result['a'] * bandwidth:.1f} bytes, {result['a'] * bandwidth / 2:.1f} per "
            "GEMM it enters"
        )
        print(
            f"b = {result['b'] * 1e12:.2f} ps per element of the output gradient (M x N): "
            f"{result['b'] * bandwidth:.1f} bytes, {result['b'] * bandwidth / 2:.1f} per "
            "GEMM it enters"
        )
        print(
            f"fitted: median error {100 * result['median']:.1f}%, worst "
            f"{100 * result['worst']:.0f}%"
        )
        return 0
    errors = {half: [] for half in HALVES}
    print(
        "| M | K | N | half | measured | planned | planned / measured "
        "|\n|---:|---:|---:|---|---:|---:|---:|"
    )
    for half in HALVES:
        for m, k, n, speedup in rows(args.min_m, half):
            planned = planned_speedup(m, k, n)
            errors[half].append(abs(planned / speedup - 1))
            print(
                f"| {m} | {k} | {n} | {half} | {speedup:.2f} | {planned:.2f} | "
                f"x{planned / speedup:.2f} |",
                flush=True,
            )
    for half, errs in errors.items():
        print(
            f"{half}: median error {100 * statistics.median(errs):.1f}%, worst "
            f"{100 * max(errs):.0f}% "
            f"over {len(errs)} shapes"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
