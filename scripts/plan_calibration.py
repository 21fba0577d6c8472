"""Plan every point of the published calibration set (issue 42) and print, or write into README.md,
a table of measured against planned tokens/s per GPU and memory, with the median and worst error.

    .venv/bin/python scripts/plan_calibration.py [--readme] [--only PATTERN] [--list]

The points are TorchTitan's own measurements (the pytorch/torchtitan repository's ``benchmarks/``
folder): Llama 3.1 8B, 70B and 405B on the 500 W, 96 GB HBM2e H100 (``llama3_h100_202412_torchtitan.md``,
tables 1-5; ``asyncTP_llama3_h100_2025-06_torchtitan.md``, its vanilla-TP columns) and 8B on H200
(``llama3-8b_h200_202506_trainy-whitefiber.md``). Each is the ``llama``
family at Llama 3.1's shape (``--model`` overrides of the Llama-8B recipe), with the run's batch,
sequence, parallelism, activation checkpointing, compile and float8 from that file and TorchTitan's
``llama3_8b.toml`` / ``llama3_70b.toml`` at the commit it names (sequence 8192, selective
checkpointing per op). Memory is TorchTitan's logged max reserved, compared with the plan's
reserved peak. Both sets ran torch before 2.9, whose SDPA runs FlashAttention-2 on Hopper (cuDNN
first from 2.9: pytorch/pytorch#162073), so their attention is planned on the flash backend; and
what TorchTitan compiled follows its version: the blocks alone in 2024-12, the blocks and the
loss by 2025-06. Planning an 8B point takes under a minute on a 2-core machine, a 70B point two,
and a 405B pipeline point about 25 minutes (each of its eight stages records its eight microbatches);
``--only`` picks points.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from canon_titan.plan.gpus import GIB, GPUS  # noqa: E402
from canon_titan.plan.planner import plan  # noqa: E402
from canon_titan.tools.fileio import write_atomic  # noqa: E402

RECIPE = REPO / "train_configs" / "Llama-8B-Nemo-1T-lr0.003.toml"
LLAMA31 = {
    "8B": ["--model.rope_theta", "500000"],
    "70B": ["--model.dim", "8192", "--model.n_layers", "80", "--model.n_heads", "64", "--model.n_kv_heads", "8",
            "--model.ffn_hidden_dim", "28672", "--model.rope_theta", "500000"],
    "405B": ["--model.dim", "16384", "--model.n_layers", "126", "--model.n_heads", "128", "--model.n_kv_heads", "8",
             "--model.ffn_hidden_dim", "53248", "--model.rope_theta", "500000"],
}
"""Llama 3.1's shapes (their config.json) in the ``llama`` family; the 8B recipe is 8B already."""
H100_2024 = "benchmarks/llama3_h100_202412_torchtitan.md"
H200_2025 = "benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
H100_2025_TP = "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
MARKERS = ("<!-- plan:published -->", "<!-- /plan:published -->")


def _run(local: int, global_: int, seq: int, ac: str, compile_: bool, float8: bool, *extra: str,
         compiled: str = '["model"]') -> list[str]:
    """``compiled``: what TorchTitan's compile covered at the run's commit (December 2024: each
    block, ``apply_compile``; the loss was compiled too from early 2025)."""
    return ["--training.local_batch_size", str(local), "--training.global_batch_size", str(global_),
            "--training.seq_len", str(seq), "--activation_checkpoint.mode", ac,
            "--compile.enable", str(compile_).lower(), "--compile.components", compiled,
            "--float8.enable", str(float8).lower(), *extra]


@dataclass
class Point:
    source: str
    label: str
    model: str
    gpus: int
    gpu: str
    overrides: list[str]
    tokens_per_s: float
    """Measured tokens/s per GPU."""
    memory_gib: float | None
    """Measured max reserved (None where the source gives tokens/s alone)."""
    attention: str = "flash"
    """The SDPA backend the run's torch picked (every point here ran torch < 2.9: flash)."""

    @property
    def key(self) -> str:
        return f"{Path(self.source).stem}: {self.label}"


POINTS = [
    *(Point(H100_2024, f"table 1, 8B, FSDP 8{name}", "8B", 8, "h100-hbm2e",
            _run(2, 16, 8192, "selective", c, f), tps, mem)
      for name, c, f, tps, mem in ((" (eager)", False, False, 5762, 82.4), (" + compile", True, False, 6667, 77.0),
                                   (" + compile + float8", True, True, 8532, 76.8))),
    *(Point(H100_2024, f"table 3, 8B, FSDP 128{name}", "8B", 128, "h100-hbm2e",
            _run(2, 256, 8192, "selective", c, f), tps, mem)
      for name, c, f, tps, mem in ((" (eager)", False, False, 5605, 67.0), (" + compile", True, False, 6514, 62.0),
                                   (" + compile + float8", True, True, 8380, 61.8))),
    *(Point(H100_2024, f"table 2, 8B, FSDP {8 // cp} x CP {cp}, sequence {seq}", "8B", 8, "h100-hbm2e",
            _run(1, 8 // cp, seq, "full", True, True, "--parallelism.context_parallel_degree", str(cp)), tps, mem)
      for cp, seq, tps, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                (8, 262144, 548, 84.5))),
    Point(H100_2024, "table 4, 70B, FSDP 32 x TP 8", "70B", 256, "h100-hbm2e",
          _run(16, 512, 8192, "full", True, True, "--parallelism.tensor_parallel_degree", "8"), 829, 71.9),
    # Table 5: 405B on TorchTitan's 3D layout, eight microbatches of 4 (the pipeline's default then:
    # as many microbatches as stages; looped schedules put two stages on each rank). It ran async
    # TP, which canon-titan does not have: the plan's TP is vanilla.
    *(Point(H100_2024, f"table 5, 405B, FSDP 8 x TP 8 x PP 8, {schedule} (async TP; planned vanilla)", "405B", 512,
            "h100-hbm2e", _run(32, 256, 8192, "full", True, True, "--parallelism.tensor_parallel_degree", "8",
                               "--parallelism.pipeline_parallel_degree", "8", "--parallelism.pipeline_parallel_schedule",
                               schedule, "--parallelism.pipeline_parallel_microbatch_size", "4"), tps, mem)
      for schedule, tps, mem in (("1F1B", 100, 82.5), ("Interleaved1F1B", 128, 72.7))),
    # The vanilla-TP columns of the June 2025 async-TP benchmark (tokens/s only): TorchTitan's
    # llama3 tomls with the commands that file gives; no gradient accumulation (global batch =
    # local batch x FSDP degree).
    *(Point(H100_2025_TP, f"{model}, FSDP {fsdp} x TP 8, {name}", model, 8 * fsdp, "h100-hbm2e",
            _run(local, local * fsdp, 8192, ac, True, recipe is not None, "--parallelism.tensor_parallel_degree", "8",
                 *(["--float8.recipe_name", recipe] if recipe else []), compiled='["model", "loss"]'), tps, None)
      for model, fsdp, local, ac, rows in (
          ("70B", 32, 16, "full", (("bf16", None, 597.3), ("float8 tensorwise", "tensorwise", 809.8),
                                   ("float8 rowwise", "rowwise", 599.6))),
          ("8B", 8, 12, "selective", (("bf16", None, 4378), ("float8 tensorwise", "tensorwise", 5078.1),
                                      ("float8 rowwise", "rowwise", 3708.5))))
      for name, recipe, tps in rows),
    *(Point(H200_2025, f"8B, FSDP {gpus}, compile + float8", "8B", gpus, "h200",
            _run(2, 2 * gpus, 8192, "selective", True, True, compiled='["model", "loss"]'), tps, mem)
      for gpus, tps, mem in ((32, 10938, 47.96), (64, 10753, 46.97))),
]


def plan_point(point: Point, log):
    started = time.perf_counter()
    result = plan(str(RECIPE), LLAMA31[point.model] + point.overrides, gpus=point.gpus, gpu=GPUS[point.gpu],
                  advise=False, attention=point.attention)
    log(f"{point.key}: planned in {time.perf_counter() - started:.0f} s")
    return result


def table(points: list[Point], log) -> list[str]:
    rows = ["| source | configuration | GPUs | measured tokens/s per GPU | planned | planned / measured "
            "| measured memory (max reserved) | planned | planned / measured |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    errors = {"tokens/s": [], "memory": []}
    for point in points:
        try:
            result = plan_point(point, log)
        except Exception as e:  # a point that cannot be planned is a row saying why
            log(f"{point.key}: {type(e).__name__}: {e}")
            rows.append(f"| `{point.source}` | {point.label} | {point.gpus} x {GPUS[point.gpu].name} | "
                        f"{point.tokens_per_s:,.0f} | not planned: {str(e).splitlines()[0][:120]} | | "
                        f"{point.memory_gib or 'not published'}{' GiB' if point.memory_gib else ''} | | |")
            continue
        tokens = result.tokens_per_s_per_gpu / point.tokens_per_s
        errors["tokens/s"].append(abs(tokens - 1))
        planned_gib = result.worst.reserved_bytes / GIB
        if point.memory_gib is None:
            memory_cells = f"not published | {planned_gib:.1f} GiB | -"
        else:
            memory = planned_gib / point.memory_gib
            errors["memory"].append(abs(memory - 1))
            memory_cells = f"{point.memory_gib} GiB | {planned_gib:.1f} GiB | x{memory:.2f}"
        rows.append(f"| `{point.source}` | {point.label} | {point.gpus} x {GPUS[point.gpu].name} | "
                    f"{point.tokens_per_s:,.0f} | {result.tokens_per_s_per_gpu:,.0f} | x{tokens:.2f} | "
                    f"{memory_cells} |")
        gc.collect()
    rows.append("")
    for name, errs in errors.items():
        if errs:
            rows.append(f"- {name}: median error {100 * statistics.median(errs):.0f}%, worst "
                        f"{100 * max(errs):.0f}% over {len(errs)} points")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readme", action="store_true", help="write the table into README.md between its markers")
    parser.add_argument("--only", help="points whose 'file: label' matches this glob (e.g. '*table 1*')")
    parser.add_argument("--list", action="store_true", help="list the points and exit")
    args = parser.parse_args()
    points = [p for p in POINTS if not args.only or fnmatch.fnmatch(p.key, args.only)]
    if args.list:
        print("\n".join(p.key for p in points))
        return 0

    def log(message: str) -> None:
        print(f"[plan_calibration] {message}", file=sys.stderr, flush=True)

    rows = table(points, log)
    if not args.readme:
        print("\n".join(rows))
        return 0
    readme = REPO / "README.md"
    text = readme.read_text()
    start, end = MARKERS
    if start not in text or end not in text:
        raise SystemExit(f"README.md has no {start} ... {end} block")
    before, rest = text.split(start, 1)
    _, after = rest.split(end, 1)
    stamp = f"_Planned {datetime.date.today()} with `scripts/plan_calibration.py`" + (
        f" --only '{args.only}'" if args.only else "") + "._"
    write_atomic(readme, before + start + "\n" + "\n".join(rows) + "\n\n" + stamp + "\n" + end + after)
    log(f"wrote {len(points)} points into {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
