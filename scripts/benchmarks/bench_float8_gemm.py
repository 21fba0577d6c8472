"""Float8 GEMMs as torchao's recipes run them, against bf16, at the linear shapes of runs the
planner is held to: what the planner cannot take from any source in text (issue 42: the row-wise
GEMM kernel).

For each linear of a Llama block (wq, wk, wv, wo, w1, w3, w2, each at its tensor-parallel shard) the
three GEMMs of a training step, each run three ways:

- bf16: ``torch.mm`` on the layouts ``F.linear`` and its backward use;
- tensorwise: ``torch._scaled_mm`` with one scale per operand, fast accumulation in the forward GEMM
  only (torchao's ``Float8LinearConfig``: ``gemm_config_output`` fast, the backward GEMMs not);
- rowwise: the forward GEMM with a scale per row and column and fast accumulation (PyTorch's
  row-wise kernel); the backward GEMMs as torchao runs them with slow accumulation: the tensor-wise
  kernel at unit scales, then the output multiplied in place by the outer product of the scales
  (``torchao.float8.float8_ops.addmm_float8_unwrapped``).

Prints a table and writes ``--json``: per run and GEMM (forward, grad_input, grad_weight) the
milliseconds of the block's seven GEMMs in each way, and their TFLOP. On a CPU (``--tiny``: toy
shapes) it checks that the script runs; the figures mean nothing there.

    .venv/bin/python scripts/benchmarks/bench_float8_gemm.py [--tokens N] [--reps R] [--json OUT]
        [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from canon_titan.tools.fileio import write_atomic  # noqa: E402

LLAMA31 = {
    "8B": ["--model.rope_theta", "500000"],
    "70B": [
        "--model.dim",
        "8192",
        "--model.n_layers",
        "80",
        "--model.n_heads",
        "64",
        "--model.n_kv_heads",
        "8",
        "--model.ffn_hidden_dim",
        "28672",
        "--model.rope_theta",
        "500000",
    ],
}
"""Llama 3.1's shapes as overrides of the Llama-8B recipe (``scripts/plan_calibration.py``'s)."""
RUNS = [
    # (label, recipe, overrides, TP degree): the June 2025 TP 8 calibration points and the H200
    # gpu_check float8 runs (LlamaCanon-1B, one GPU).
    ("Llama 3.1 8B, TP 8", "Llama-8B-Nemo-1T-lr0.003", LLAMA31["8B"], 8),
    ("Llama 3.1 70B, TP 8", "Llama-8B-Nemo-1T-lr0.003", LLAMA31["70B"], 8),
    ("LlamaCanon-1B, TP 1", "LlamaCanon-1B-Nemo-1T-lr0.003", [], 1),
]
GEMMS = ("forward", "grad_input", "grad_weight")
WAYS = ("bf16", "tensorwise", "rowwise")
E4M3 = torch.float8_e4m3fn


def block_linears(recipe: str, overrides: list[str], tp: int) -> list[tuple[str, int, int]]:
    """(name, in features, out features) of one block's linears at their TP shard: column-parallel
    wq, wk, wv, w1, w3 split their outputs, row-parallel wo, w2 their inputs."""
    from unittest.mock import patch

    from canon_titan.config import load

    with patch.dict(os.environ, WORLD_SIZE="1"):
        args = load(
            str(REPO / "train_configs" / f"{recipe}.toml"), overrides, environment=False
        ).model_args
    dim, q, kv, hidden = (
        args.dim,
        args.n_heads * args.head_dim,
        args.kv_heads * args.head_dim,
        args.hidden_dim,
    )
    return [
        ("wq", dim, q // tp),
        ("wk", dim, kv // tp),
        ("wv", dim, kv // tp),
        ("wo", q // tp, dim),
        ("w1", dim, hidden // tp),
        ("w3", dim, hidden // tp),
        ("w2", hidden // tp, dim),
    ]


def operands(gemm: str, tokens: int, k_in: int, n_out: int) -> tuple[int, int, int]:
    """(M, K, N) of ``gemm`` for a linear of ``k_in`` -> ``n_out`` features on ``tokens`` rows:
    output = x @ W^T, grad_input = grad_out @ W, grad_weight = grad_out^T @ x."""
    return {
        "forward": (tokens, k_in, n_out),
        "grad_input": (tokens, n_out, k_in),
        "grad_weight": (n_out, tokens, k_in),
    }[gemm]


def _timer(device: torch.device, reps: int):
    def measure(fn) -> float:
        """Median milliseconds of ``fn`` after a warm-up call."""
        fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                started = time.perf_counter()
                fn()
                times.append(1000 * (time.perf_counter() - started))
        return statistics.median(times)

    return measure


def gemm_ways(m: int, k: int, n: int, forward: bool, device: torch.device):
    """The three ways of one [m, k] x [k, n] GEMM, as callables on fresh operands (the second
    operand column-major, as ``_scaled_mm`` wants it and as a linear's weight is), and the float8
    ways' products computed in fp32."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()
    a8, b8 = a.to(E4M3), b.t().contiguous().to(E4M3).t()
    one = torch.ones((), device=device)
    # torchao's scales (what the high-precision tensor was multiplied by to fit float8): one per
    # tensor, or one per row of the first operand and per column of the second
    tensor_a, tensor_b = torch.full((), 2.0, device=device), torch.full((), 0.5, device=device)
    row_a, col_b = torch.rand(m, 1, device=device) + 0.5, torch.rand(1, n, device=device) + 0.5

    def tensorwise():
        return torch._scaled_mm(
            a8,
            b8,
            scale_a=tensor_a.reciprocal(),
            scale_b=tensor_b.reciprocal(),
            out_dtype=torch.bfloat16,
            use_fast_accum=forward,
        )

    def rowwise():
        inverse_a, inverse_b = row_a.reciprocal(), col_b.reciprocal()
        if forward:
            return torch._scaled_mm(
                a8,
                b8,
                scale_a=inverse_a,
                scale_b=inverse_b,
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )
        out = torch._scaled_mm(
            a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=False
        )
        out *= inverse_a * inverse_b
        return out

    def reference(way: str) -> torch.Tensor:
        """What ``way`` computes, in fp32 from its float8 operands (the tests hold the ways to
        it)."""
        scales = {"tensorwise": (tensor_a, tensor_b), "rowwise": (row_a, col_b)}[way]
        return (a8.float() / scales[0]) @ (b8.float() / scales[1])

    return {"bf16": lambda: torch.mm(a, b), "tensorwise": tensorwise, "rowwise": rowwise}, reference


def measure_run(
    label: str,
    recipe: str,
    overrides: list[str],
    tp: int,
    tokens: int,
    reps: int,
    device: torch.device,
    shrink: int = 1,
) -> dict:
    measure = _timer(device, reps)
    linears = [
        (name, max(16, k // shrink), max(16, n // shrink))
        for name, k, n in block_linears(recipe, overrides, tp)
    ]
    rows = []
    for gemm in GEMMS:
        ms = dict.fromkeys(WAYS, 0.0)
        flop = 0
        for _, k_in, n_out in linears:
            m, k, n = operands(gemm, tokens, k_in, n_out)
            ways, _ = gemm_ways(m, k, n, gemm == "forward", device)
            for way, fn in ways.items():
                ms[way] += measure(fn)
            flop += 2 * m * k * n
            del ways
        rows.append({"gemm": gemm, "tflop": flop / 1e12, **{f"{w}_ms": ms[w] for w in WAYS}})
    return {"label": label, "tp": tp, "tokens": tokens, "linears": linears, "rows": rows}


def table(result: dict) -> list[str]:
    lines = [
        f"Float8 GEMMs of one block, {result['device']}, {result['tokens']:,} tokens (ms; TFLOP/s)",
        "",
        "| run | GEMM | TFLOP | bf16 | tensorwise | rowwise | rowwise / tensorwise | "
        "tensorwise / bf16 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result["runs"]:
        for r in run["rows"]:
            rate = {w: r["tflop"] / (r[f"{w}_ms"] / 1000) for w in WAYS}
            lines.append(
                f"| {run['label']} | {r['gemm']} | {r['tflop']:.3f} | "
                + " | ".join(f"{r[f'{w}_ms']:.3f} ({rate[w]:,.0f})" for w in WAYS)
                + f" | x{r['rowwise_ms'] / r['tensorwise_ms']:.2f} | "
                f"x{r['tensorwise_ms'] / r['bf16_ms']:.2f} |"
            )
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=16384,
        help="rows of each GEMM: tokens per TP rank's step (default 16384)",
    )
    p.add_argument(
        "--reps", type=int, default=10, help="timed calls per GEMM (default 10; the median is kept)"
    )
    p.add_argument("--json", help="write the figures here")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="toy shapes on the CPU: checks the script, measures nothing",
    )
    args = p.parse_args(argv)
    if args.tokens <= 0 or args.reps <= 0:
        p.error("--tokens and --reps must be positive")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cpu" and not args.tiny:
        p.error("no GPU: float8 GEMMs are timed on a GPU (--tiny checks the script on the CPU)")
    tokens, reps, shrink = (64, 1, 128) if args.tiny else (args.tokens, args.reps, 1)
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "tokens": tokens,
        "torch": torch.__version__,
        "runs": [],
    }
    for label, recipe, overrides, tp in RUNS:
        result["runs"].append(
            measure_run(label, recipe, overrides, tp, tokens, reps, device, shrink)
        )
        print(f"[bench_float8_gemm] {label}: done", file=sys.stderr, flush=True)
    print("\n".join(table(result)))
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
