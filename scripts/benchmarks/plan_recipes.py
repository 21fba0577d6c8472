"""Plan every shipped release recipe at its reference GPU count (its header's "Reference run: N
GPUs") on the release's GPU (H200), and the GPU-measured configurations against their
measurements; print both tables as Markdown, or write them into docs/benchmarks/planner.md between their markers.

    .venv/bin/python scripts/benchmarks/plan_recipes.py [--docs] [--only PATTERN] [--gpu h200]
        [--no-calibration | --no-recipes]

Recipes that differ only in learning rate share a plan (a 2T-token recipe scales the GPU-hours
of its 1T twin's plan by its steps). Each plan takes 5-40 s on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import gc
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from canon_titan.plan.gpus import GIB, GPUS, find_gpu  # noqa: E402
from canon_titan.plan.planner import plan  # noqa: E402
from canon_titan.tools.fileio import write_atomic  # noqa: E402

REFERENCE = re.compile(r"^# Reference run: (\d+) GPUs x (\d+) sequences? x (\d+) tokens", re.M)
RELEASE_GPU_HOURS_1B_1T = 5200
"""The release's figure: "1B x 1T tokens ~ 5,200 H200 GPU-hours" (PhysicsLM4 README)."""

# GPU measurements the planner is held to: the offline GPU kit's table (../shared/gpu/README.md,
# H100, torch 2.11, Triton 3.6, 2026-11-22): one GPU, the recipe's shape on the built-in data
# (vocabulary 784), batch 2 x 4096, compile, no activation checkpointing.
BF16 = ["--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16"]
SEQ_16K = ["--training.seq_len", "16384", "--training.local_batch_size", "1", "--training.global_batch_size", "1"]
CALIBRATION = [
    ("Llama-1B", "Llama-1B-Nemo-1T-lr0.003", [], "h100", 45_200, 33.4, "2026-11-22, H100, torch 2.11"),
    ("LlamaCanon-1B, torch Canon backend", "LlamaCanon-1B-Nemo-1T-lr0.003", ["--model.canon_backend", "torch"],
     "h100", 33_400, 46.3, "2026-11-22, H100, torch 2.11"),
    # scripts/gpu_check.sh, 2026-11-26: one H200, torch 2.11, Triton 3.6, the same shape with bf16 weights
    # and optimizer state (the benchmarks' setting on one GPU, where no FSDP casts fp32 weights).
    ("Llama-1B, bf16 weights", "Llama-1B-Nemo-1T-lr0.003", BF16, "h200", 48_527, 25.5, "2026-11-26, H200, torch 2.11"),
    ("LlamaCanon-1B, Triton Canon op, bf16 weights", "LlamaCanon-1B-Nemo-1T-lr0.003",
     ["--model.canon_backend", "triton", *BF16], "h200", 33_402, 26.3, "2026-11-26, H200, torch 2.11"),
    ("LlamaCanon-1B, Triton Canon op, bf16 weights, float8 tensorwise", "LlamaCanon-1B-Nemo-1T-lr0.003",
     ["--model.canon_backend", "triton", *BF16, "--float8.enable", "true", "--float8.recipe_name", "tensorwise"],
     "h200", 32_111, 25.1, "2026-11-26, H200, torch 2.11"),
    ("LlamaCanon-1B, Triton Canon op, bf16 weights, float8 rowwise", "LlamaCanon-1B-Nemo-1T-lr0.003",
     ["--model.canon_backend", "triton", *BF16, "--float8.enable", "true", "--float8.recipe_name", "rowwise"],
     "h200", 25_056, 25.1, "2026-11-26, H200, torch 2.11"),
    # scripts/gpu_check.sh, 2026-11-27: the same H200 kit, the Canon backward kernels with their loops
    # rewritten; the loss step's leftover processes shared the host then (docs/benchmarks/gpu.md). The
    # linear recipes train at 16384: measured, and planned, at 4096.
    ("Llama-1B, bf16 weights", "Llama-1B-Nemo-1T-lr0.003", BF16, "h200", 42_158, 25.5, "2026-11-27, H200, torch 2.11"),
    ("LlamaCanon-1B, Triton Canon op, bf16 weights", "LlamaCanon-1B-Nemo-1T-lr0.003",
     ["--model.canon_backend", "triton", *BF16], "h200", 35_580, 26.3, "2026-11-27, H200, torch 2.11"),
    ("Mamba2Canon-1B, mamba-ssm SSD kernel, bf16 weights", "Mamba2Canon-1B-Nemo-1T-lr0.003",
     ["--model.kernel_backend", "mamba_ssm", "--training.seq_len", "4096", *BF16], "h200", 32_683, 27.4, "2026-11-27, H200, torch 2.11"),
    ("GDN2Canon-1B, torch recurrence kernel, bf16 weights", "GDN2Canon-1B-Nemo-1T-lr0.003",
     ["--model.kernel_backend", "torch", "--training.seq_len", "4096", *BF16], "h200", 9_091, 63.0, "2026-11-27, H200, torch 2.11"),
    # scripts/gpu_lease.sh (one gpu_check.sh run across the lease's two calls), 2026-11-28: the same H200 kit and
    # kernels, a host of its own (no leftover processes); the 16k runs at batch 1.
    ("Llama-1B, bf16 weights", "Llama-1B-Nemo-1T-lr0.003", BF16, "h200", 45_904, 25.5, "2026-11-28, H200, torch 2.11"),
    ("LlamaCanon-1B, Triton Canon op, bf16 weights", "LlamaCanon-1B-Nemo-1T-lr0.003",
     ["--model.canon_backend", "triton", *BF16], "h200", 38_004, 26.2, "2026-11-28, H200, torch 2.11"),
    ("LlamaCanon-1B, Triton Canon op, bf16 weights, float8 tensorwise", "LlamaCanon-1B-Nemo-1T-lr0.003",
     ["--model.canon_backend", "triton", *BF16, "--float8.enable", "true", "--float8.recipe_name", "tensorwise"],
     "h200", 31_422, 25.1, "2026-11-28, H200, torch 2.11"),
    ("LlamaCanon-1B, Triton Canon op, bf16 weights, float8 rowwise", "LlamaCanon-1B-Nemo-1T-lr0.003",
     ["--model.canon_backend", "triton", *BF16, "--float8.enable", "true", "--float8.recipe_name", "rowwise"],
     "h200", 32_922, 25.1, "2026-11-28, H200, torch 2.11"),
    ("Mamba2Canon-1B, mamba-ssm SSD kernel, bf16 weights", "Mamba2Canon-1B-Nemo-1T-lr0.003",
     ["--model.kernel_backend", "mamba_ssm", "--training.seq_len", "4096", *BF16], "h200", 19_189, 27.4, "2026-11-28, H200, torch 2.11"),
    ("Llama-1B at 16384, batch 1, bf16 weights", "Llama-1B-Nemo-1T-lr0.003",
     [*SEQ_16K, *BF16], "h200", 35_294, 39.6, "2026-11-28, H200, torch 2.11"),
    ("Mamba2Canon-1B at 16384, batch 1, mamba-ssm SSD kernel, bf16 weights", "Mamba2Canon-1B-Nemo-1T-lr0.003",
     ["--model.kernel_backend", "mamba_ssm", *SEQ_16K, *BF16], "h200", 42_759, 43.7, "2026-11-28, H200, torch 2.11"),
]
CALIBRATION_SHAPE = ["--training.local_batch_size", "2", "--training.global_batch_size", "2",
                     "--model.vocab_size", "784"]
MARKERS = {"recipes": ("<!-- plan:recipes -->", "<!-- /plan:recipes -->"),
           "calibration": ("<!-- plan:calibration -->", "<!-- /plan:calibration -->")}


def recipes(pattern: str | None):
    """(model, size, reference GPU count) -> the recipes of that shape, with their token counts."""
    shapes: dict[tuple, list] = {}
    for path in sorted((REPO / "train_configs").glob("*-Nemo-*.toml")):
        if pattern and not fnmatch.fnmatch(path.stem, pattern):
            continue
        match = REFERENCE.search(path.read_text())
        if match is None:
            raise SystemExit(f"{path}: no 'Reference run: N GPUs x B sequences x T tokens' header")
        name, size, tokens = re.match(r"(\w+?)-(\d+B)-Nemo-(\d+T)", path.stem).group(1, 2, 3)
        shapes.setdefault((name, size, int(match.group(1))), []).append((path, tokens))
    return shapes


def recipe_label(entries) -> str:
    """The recipe files a row plans, as a name a user can type: ``Llama-1B-Nemo-2T-lr{0.003,0.005}``."""
    stems = sorted(path.stem for path, _ in entries)
    heads = dict.fromkeys(stem.rsplit("-lr", 1)[0] for stem in stems)
    return " / ".join(head + "-lr{" + ",".join(s.rsplit("-lr", 1)[1] for s in stems if s.startswith(head + "-lr"))
                      + "}" for head in heads)


def recipe_table(gpu_name: str, pattern: str | None, log) -> list[str]:
    gpu = find_gpu(gpu_name)
    rows = [f"| recipes | GPUs | batch per GPU | peak memory (of {gpu.memory_gib:.0f} GiB) | fits | tokens/s per GPU "
            f"| MFU | step | GPU-hours (1T tokens) |", "|---|---:|---|---:|---|---:|---:|---:|---:|"]
    for (model, size, gpus), entries in recipes(pattern).items():
        path = entries[0][0]
        started = time.perf_counter()
        result = plan(str(path), [], gpus=gpus, gpu=gpu, advise=False)
        log(f"{model}-{size} on {gpus} x {gpu.name}: {time.perf_counter() - started:.0f} s")
        hours = result.gpu_hours * 1e12 / (result.steps * result.tokens_per_step)  # per 1T tokens
        worst = result.worst
        rows.append(f"| {recipe_label(entries)} | {gpus} | {result.local_batch} x {result.seq_len} | "
                    f"{worst.device_bytes / GIB:.1f} GiB | {'yes' if result.fits else '**no**'} | "
                    f"{result.tokens_per_s_per_gpu:,.0f} | {100 * result.mfu:.1f}% | {result.step_s:.2f} s | "
                    f"{hours:,.0f} |")
        gc.collect()
    return rows


def calibration_table(log) -> list[str]:
    rows = ["| configuration | GPU | measured tokens/s | planned | planned / measured | measured memory | planned "
            "| planned / measured | measured on |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for label, recipe, extra, gpu_name, tokens, memory, when in CALIBRATION:
        gpu = GPUS[gpu_name]
        result = plan(str(REPO / "train_configs" / f"{recipe}.toml"), CALIBRATION_SHAPE + extra, gpus=1, gpu=gpu,
                      advise=False)
        log(f"calibration {label}: planned in {result.planner_s:.0f} s")
        planned_memory = result.worst.reserved_bytes / GIB
        rows.append(f"| {label} | {gpu.name} | {tokens:,} | {result.tokens_per_s_per_gpu:,.0f} | "
                    f"x{result.tokens_per_s_per_gpu / tokens:.2f} | {memory} GiB | {planned_memory:.1f} GiB | "
                    f"x{planned_memory / memory:.2f} | {when} |")
    return rows


def split_block(text: str, start: str, end: str) -> tuple[str, str, str]:
    """docs/benchmarks/planner.md's text before, between and after a pair of markers."""
    if start not in text or end not in text:
        raise SystemExit(f"docs/benchmarks/planner.md has no {start} ... {end} block")
    before, rest = text.split(start, 1)
    body, after = rest.split(end, 1)
    return before, body, after


def replace_block(text: str, name: str, rows: list[str], *, markers: tuple[str, str] | None = None,
                  stamp: str | None = None) -> str:
    start, end = markers or MARKERS[name]
    before, _, after = split_block(text, start, end)
    stamp = stamp or f"_Planned {datetime.date.today()} with `scripts/benchmarks/plan_recipes.py`._"
    return before + start + "\n" + "\n".join(rows) + "\n\n" + stamp + "\n" + end + after


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", action="store_true", help="write the tables into docs/benchmarks/planner.md")
    parser.add_argument("--only", help="recipes whose name matches this glob (e.g. 'Llama*-1B-*')")
    parser.add_argument("--gpu", default="h200", help="the GPU of the recipe table (default h200, the release's)")
    parser.add_argument("--no-calibration", action="store_true")
    parser.add_argument("--no-recipes", action="store_true", help="the GPU-measured table alone")
    args = parser.parse_args()

    def log(message: str) -> None:
        print(f"[plan_recipes] {message}", file=sys.stderr, flush=True)

    tables = {} if args.no_recipes else {"recipes": recipe_table(args.gpu, args.only, log)}
    if not args.no_calibration:
        tables["calibration"] = calibration_table(log)
    if args.docs:
        page = REPO / "docs" / "benchmarks" / "planner.md"
        text = page.read_text()
        for name, rows in tables.items():
            text = replace_block(text, name, rows)
        write_atomic(page, text)
        log(f"wrote {', '.join(tables)} into {page}")
    else:
        for rows in tables.values():
            print("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
