"""Plan every shipped release recipe at its reference GPU count (its header's "Reference run: N
GPUs") on the release's GPU (H200), and the GPU-measured configurations against their
measurements; print both tables as Markdown, or write them into docs/benchmarks/planner.md between
their markers (and, with the calibration table, the planned figures of the GPU runs in use, from
which `canon-titan plan` prints its error band, into canon_titan/assets/plan_calibration.json).

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

from canon_titan.plan.calibration import PLANNED_FILE, POINTS, in_use, write_planned  # noqa: E402
from canon_titan.plan.gpus import GIB, GPUS, find_gpu  # noqa: E402
from canon_titan.plan.planner import plan  # noqa: E402
from canon_titan.tools.fileio import write_atomic  # noqa: E402

REFERENCE = re.compile(r"^# Reference run: (\d+) GPUs x (\d+) sequences? x (\d+) tokens", re.M)
RELEASE_GPU_HOURS_1B_1T = 5200
"""The release's figure: "1B x 1T tokens ~ 5,200 H200 GPU-hours" (PhysicsLM4 README)."""

MARKERS = {
    "recipes": ("<!-- plan:recipes -->", "<!-- /plan:recipes -->"),
    "calibration": ("<!-- plan:calibration -->", "<!-- /plan:calibration -->"),
}


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
    """The recipe files a row plans, as a name a user can type:
    ``Llama-1B-Nemo-2T-lr{0.003,0.005}``."""
    stems = sorted(path.stem for path, _ in entries)
    heads = dict.fromkeys(stem.rsplit("-lr", 1)[0] for stem in stems)
    return " / ".join(
        head
        + "-lr{"
        + ",".join(s.rsplit("-lr", 1)[1] for s in stems if s.startswith(head + "-lr"))
        + "}"
        for head in heads
    )


def recipe_table(gpu_name: str, pattern: str | None, log) -> list[str]:
    gpu = find_gpu(gpu_name)
    rows = [
        f"| recipes | GPUs | batch per GPU | peak memory (of {gpu.memory_gib:.0f} GiB) | "
        "fits | tokens/s per GPU "
        f"| MFU | step | GPU-hours (1T tokens) |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for (model, size, gpus), entries in recipes(pattern).items():
        path = entries[0][0]
        started = time.perf_counter()
        result = plan(str(path), [], gpus=gpus, gpu=gpu, advise=False)
        log(f"{model}-{size} on {gpus} x {gpu.name}: {time.perf_counter() - started:.0f} s")
        hours = result.gpu_hours * 1e12 / (result.steps * result.tokens_per_step)  # per 1T tokens
        worst = result.worst
        rows.append(
            f"| {recipe_label(entries)} | {gpus} | {result.local_batch} x {result.seq_len} | "
            f"{worst.device_bytes / GIB:.1f} GiB | {'yes' if result.fits else '**no**'} | "
            f"{result.tokens_per_s_per_gpu:,.0f} | {100 * result.mfu:.1f}% | "
            f"{result.step_s:.2f} s | "
            f"{hours:,.0f} |"
        )
        gc.collect()
    return rows


def calibration_table(log, planned: dict[str, float]) -> list[str]:
    """The table of every GPU run against its plan; ``planned`` gets the figures of the runs in
    use."""
    rows = [
        "| configuration | GPU | measured tokens/s | planned | planned / measured | "
        "measured memory | planned "
        "| planned / measured | measured on |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    used = {point.key for point in in_use()}
    for point in POINTS:  # canon_titan/plan/calibration.py: the GPU runs, what was measured
        gpu, tokens, memory = GPUS[point.gpu], point.measured_tokens_per_s, point.measured_gib
        result = plan(
            str(REPO / "train_configs" / f"{point.recipe}.toml"),
            list(point.overrides),
            gpus=1,
            gpu=gpu,
            advise=False,
            expandable=point.expandable_segments,
        )  # the allocator mode the run had
        log(f"calibration {point.label}: planned in {result.planner_s:.0f} s")
        if point.key in used:
            planned[point.key] = round(result.tokens_per_s_per_gpu)
        planned_memory = result.worst.reserved_bytes / GIB
        rows.append(
            f"| {point.label} | {gpu.name} | {tokens:,} | {result.tokens_per_s_per_gpu:,.0f} | "
            f"x{result.tokens_per_s_per_gpu / tokens:.2f} | "
            f"{'-' if memory is None else f'{memory} GiB'} | "
            f"{planned_memory:.1f} GiB | "
            f"{'-' if memory is None else f'x{planned_memory / memory:.2f}'} | "
            f"{point.measured_on} |"
        )
    return rows


def split_block(text: str, start: str, end: str) -> tuple[str, str, str]:
    """docs/benchmarks/planner.md's text before, between and after a pair of markers."""
    if start not in text or end not in text:
        raise SystemExit(f"docs/benchmarks/planner.md has no {start} ... {end} block")
    before, rest = text.split(start, 1)
    body, after = rest.split(end, 1)
    return before, body, after


def replace_block(
    text: str,
    name: str,
    rows: list[str],
    *,
    markers: tuple[str, str] | None = None,
    stamp: str | None = None,
) -> str:
    start, end = markers or MARKERS[name]
    before, _, after = split_block(text, start, end)
    stamp = stamp or f"_Planned {datetime.date.today()} with `scripts/benchmarks/plan_recipes.py`._"
    return before + start + "\n" + "\n".join(rows) + "\n\n" + stamp + "\n" + end + after


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--docs", action="store_true", help="write the tables into docs/benchmarks/planner.md"
    )
    parser.add_argument("--only", help="recipes whose name matches this glob (e.g. 'Llama*-1B-*')")
    parser.add_argument(
        "--gpu", default="h200", help="the GPU of the recipe table (default h200, the release's)"
    )
    parser.add_argument("--no-calibration", action="store_true")
    parser.add_argument("--no-recipes", action="store_true", help="the GPU-measured table alone")
    args = parser.parse_args()

    def log(message: str) -> None:
        print(f"[plan_recipes] {message}", file=sys.stderr, flush=True)

    tables = {} if args.no_recipes else {"recipes": recipe_table(args.gpu, args.only, log)}
    planned: dict[str, float] = {}
    if not args.no_calibration:
        tables["calibration"] = calibration_table(log, planned)
    if args.docs:
        page = REPO / "docs" / "benchmarks" / "planner.md"
        text = page.read_text()
        for name, rows in tables.items():
            text = replace_block(text, name, rows)
        write_atomic(page, text)
        log(f"wrote {', '.join(tables)} into {page}")
        if (
            planned
        ):  # the figures a plan's error band is computed from (canon_titan/plan/calibration.py)
            write_planned(planned)
            log(f"wrote the planned figures of {len(planned)} GPU runs into {PLANNED_FILE}")
    else:
        for rows in tables.values():
            print("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
