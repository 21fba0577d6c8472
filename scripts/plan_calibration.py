"""Plan every point of the published calibration set (issue 42) and print, or write into
docs/benchmarks/planner.md, a table of measured against planned tokens/s per GPU and memory, with
the median and worst error.

    .venv/bin/python scripts/plan_calibration.py [--docs] [--only PATTERN] [--list]

The points are TorchTitan's own measurements (the pytorch/torchtitan repository's ``benchmarks/``
folder): Llama 3.1 8B, 70B and 405B on the 500 W, 96 GB HBM2e H100
(``llama3_h100_202412_torchtitan.md``, tables 1-5; ``asyncTP_llama3_h100_2025-06_torchtitan.md``,
its vanilla-TP columns) and 8B on H200 (``llama3-8b_h200_202506_trainy-whitefiber.md``). Each is the
``llama`` family at Llama 3.1's shape (``--model`` overrides of the Llama-8B recipe), with the run's
batch, sequence, parallelism, activation checkpointing, compile and float8 from that file and
TorchTitan's ``llama3_8b.toml`` / ``llama3_70b.toml`` at the commit it names (sequence 8192,
selective checkpointing per op). Memory is TorchTitan's logged max reserved, compared with the
plan's reserved peak. Both sets ran torch before 2.9, whose SDPA runs FlashAttention-2 on Hopper
(cuDNN first from 2.9: pytorch/pytorch#162073), so their attention is planned on the flash backend;
and what TorchTitan compiled follows its version: the blocks alone in 2024-12, the blocks and the
loss by 2025-06; and their looped pipeline schedule gathered each block's parameters as the block
ran (torch before 2.10; the pinned torch gathers a whole stage's at once). Planning an 8B point
takes under a minute on a 2-core machine, a 70B point two, and a 405B pipeline point about 11
minutes (each of its eight stages records its eight microbatches); ``--only`` picks points.
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
    "405B": [
        "--model.dim",
        "16384",
        "--model.n_layers",
        "126",
        "--model.n_heads",
        "128",
        "--model.n_kv_heads",
        "8",
        "--model.ffn_hidden_dim",
        "53248",
        "--model.rope_theta",
        "500000",
    ],
}
"""Llama 3.1's shapes (their config.json) in the ``llama`` family; the 8B recipe is 8B already."""
H100_2024 = "benchmarks/llama3_h100_202412_torchtitan.md"
H200_2025 = "benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
H100_2025_TP = "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
FSDP_FLOAT8 = (
    "--float8.enable_fsdp_float8_all_gather",
    "true",
    "--float8.precompute_float8_dynamic_scale_for_fsdp",
    "true",
)
MARKERS = ("<!-- plan:published -->", "<!-- /plan:published -->")


def _run(
    local: int,
    global_: int,
    seq: int,
    ac: str,
    compile_: bool,
    float8: bool,
    *extra: str,
    compiled: str = '["model"]',
    recipe: str = "tensorwise",
) -> list[str]:
    """``compiled``: what TorchTitan's compile covered at the run's commit (December 2024: each
    block, ``apply_compile``; the loss was compiled too from early 2025). ``recipe``: the float8
    scaling. TorchTitan's float8 was tensor-wise dynamic scaling unless a run chose a recipe: at
    9dec370 it had no other (``--float8.scaling_type_*``: dynamic or delayed, per tensor), and
    the H200 runs of June 2025 name none (and use FSDP's float8 all-gather, a tensor-wise feature:
    ``FSDP_FLOAT8``); canon-titan's own default is ``rowwise``."""
    return [
        "--training.local_batch_size",
        str(local),
        "--training.global_batch_size",
        str(global_),
        "--training.seq_len",
        str(seq),
        "--activation_checkpoint.mode",
        ac,
        "--compile.enable",
        str(compile_).lower(),
        "--compile.components",
        compiled,
        "--float8.enable",
        str(float8).lower(),
        *(["--float8.recipe_name", recipe] if float8 else []),
        *extra,
    ]


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
    pipeline_unshard: str = "stage"
    """When a looped pipeline schedule gathered a stage's parameters
    (``fake_world.PIPELINE_UNSHARD``): the table 5 runs' torch (2024-12-23) ran Interleaved1F1B
    block by block (``layer``)."""

    @property
    def key(self) -> str:
        return f"{Path(self.source).stem}: {self.label}"


POINTS = [
    *(
        Point(
            H100_2024,
            f"table 1, 8B, FSDP 8{name}",
            "8B",
            8,
            "h100-hbm2e",
            _run(2, 16, 8192, "selective", c, f),
            tps,
            mem,
        )
        for name, c, f, tps, mem in (
            (" (eager)", False, False, 5762, 82.4),
            (" + compile", True, False, 6667, 77.0),
            (" + compile + float8", True, True, 8532, 76.8),
        )
    ),
    *(
        Point(
            H100_2024,
            f"table 3, 8B, FSDP 128{name}",
            "8B",
            128,
            "h100-hbm2e",
            _run(2, 256, 8192, "selective", c, f),
            tps,
            mem,
        )
        for name, c, f, tps, mem in (
            (" (eager)", False, False, 5605, 67.0),
            (" + compile", True, False, 6514, 62.0),
            (" + compile + float8", True, True, 8380, 61.8),
        )
    ),
    *(
        Point(
            H100_2024,
            f"table 2, 8B, FSDP {8 // cp} x CP {cp}, sequence {seq}",
            "8B",
            8,
            "h100-hbm2e",
            _run(
                1,
                8 // cp,
                seq,
                "full",
                True,
                True,
                "--parallelism.context_parallel_degree",
                str(cp),
            ),
            tps,
            mem,
        )
        for cp, seq, tps, mem in (
            (1, 32768, 3890, 83.9),
            (2, 65536, 2540, 84.2),
            (4, 131072, 1071, 84.0),
            (8, 262144, 548, 84.5),
        )
    ),
    Point(
        H100_2024,
        "table 4, 70B, FSDP 32 x TP 8",
        "70B",
        256,
        "h100-hbm2e",
        _run(16, 512, 8192, "full", True, True, "--parallelism.tensor_parallel_degree", "8"),
        829,
        71.9,
    ),
    # Table 5: 405B on TorchTitan's 3D layout, eight microbatches of 4 (the pipeline's default then:
    # as many microbatches as the pipeline degree; looped schedules put two stages on each rank). It
    # ran async TP, which canon-titan does not have: the plan's TP is vanilla. Its torch's
    # Interleaved1F1B (a PipelineScheduleMulti until torch 2.10) gathered each block's parameters
    # by FSDP's hook as it ran, not a whole stage's at once as the pinned torch does.
    *(
        Point(
            H100_2024,
            f"table 5, 405B, FSDP 8 x TP 8 x PP 8, {schedule} (async TP; planned vanilla)",
            "405B",
            512,
            "h100-hbm2e",
            _run(
                32,
                256,
                8192,
                "full",
                True,
                True,
                "--parallelism.tensor_parallel_degree",
                "8",
                "--parallelism.pipeline_parallel_degree",
                "8",
                "--parallelism.pipeline_parallel_schedule",
                schedule,
                "--parallelism.pipeline_parallel_microbatch_size",
                "4",
            ),
            tps,
            mem,
            pipeline_unshard="layer",
        )
        for schedule, tps, mem in (("1F1B", 100, 82.5), ("Interleaved1F1B", 128, 72.7))
    ),
    # The vanilla-TP columns of the June 2025 async-TP benchmark (tokens/s only): TorchTitan's
    # llama3 tomls with the commands that file gives; no gradient accumulation (global batch =
    # local batch x FSDP degree).
    *(
        Point(
            H100_2025_TP,
            f"{model}, FSDP {fsdp} x TP 8, {name}",
            model,
            8 * fsdp,
            "h100-hbm2e",
            _run(
                local,
                local * fsdp,
                8192,
                ac,
                True,
                recipe is not None,
                "--parallelism.tensor_parallel_degree",
                "8",
                compiled='["model", "loss"]',
                recipe=recipe or "tensorwise",
            ),
            tps,
            None,
        )
        for model, fsdp, local, ac, rows in (
            (
                "70B",
                32,
                16,
                "full",
                (
                    ("bf16", None, 597.3),
                    ("float8 tensorwise", "tensorwise", 809.8),
                    ("float8 rowwise", "rowwise", 599.6),
                ),
            ),
            (
                "8B",
                8,
                12,
                "selective",
                (
                    ("bf16", None, 4378),
                    ("float8 tensorwise", "tensorwise", 5078.1),
                    ("float8 rowwise", "rowwise", 3708.5),
                ),
            ),
        )
        for name, recipe, tps in rows
    ),
    # The H200 runs gathered the float8 weights in float8 with precomputed scales (their command's
    # --float8.enable_fsdp_float8_all_gather and --float8.precompute_float8_dynamic_scale_for_fsdp).
    *(
        Point(
            H200_2025,
            f"8B, FSDP {gpus}, compile + float8",
            "8B",
            gpus,
            "h200",
            _run(
                2,
                2 * gpus,
                8192,
                "selective",
                True,
                True,
                *FSDP_FLOAT8,
                compiled='["model", "loss"]',
            ),
            tps,
            mem,
        )
        for gpus, tps, mem in ((32, 10938, 47.96), (64, 10753, 46.97))
    ),
]


def plan_point(point: Point, log):
    started = time.perf_counter()
    result = plan(
        str(RECIPE),
        LLAMA31[point.model] + point.overrides,
        gpus=point.gpus,
        gpu=GPUS[point.gpu],
        advise=False,
        attention=point.attention,
        pipeline_unshard=point.pipeline_unshard,
    )
    log(f"{point.key}: planned in {time.perf_counter() - started:.0f} s")
    return result


def point_row(point: Point, log) -> str:
    """The point's table row, planned now (a point that cannot be planned is a row saying why)."""
    try:
        result = plan_point(point, log)
    except Exception as e:
        log(f"{point.key}: {type(e).__name__}: {e}")
        return (
            f"| `{point.source}` | {point.label} | {point.gpus} x {GPUS[point.gpu].name} | "
            f"{point.tokens_per_s:,.0f} | not planned: {str(e).splitlines()[0][:120]} | | "
            f"{point.memory_gib or 'not published'}{' GiB' if point.memory_gib else ''} | | |"
        )
    tokens = result.tokens_per_s_per_gpu / point.tokens_per_s
    planned_gib = result.worst.reserved_bytes / GIB
    if point.memory_gib is None:
        memory_cells = f"not published | {planned_gib:.1f} GiB | -"
    else:
        memory_cells = (
            f"{point.memory_gib} GiB | {planned_gib:.1f} GiB | "
            f"x{planned_gib / point.memory_gib:.2f}"
        )
    gc.collect()
    return (
        f"| `{point.source}` | {point.label} | {point.gpus} x {GPUS[point.gpu].name} | "
        f"{point.tokens_per_s:,.0f} | {result.tokens_per_s_per_gpu:,.0f} | x{tokens:.2f} | "
        f"{memory_cells} |"
    )


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _page_block(text: str) -> tuple[str, str, str]:
    """docs/benchmarks/planner.md's text before, inside and after the table's markers."""
    start, end = MARKERS
    if start not in text or end not in text:
        raise SystemExit(f"docs/benchmarks/planner.md has no {start} ... {end} block")
    before, rest = text.split(start, 1)
    body, after = rest.split(end, 1)
    return before, body, after


def _rows_by_label(body: str) -> dict[str, str]:
    return {_cells(row)[1]: row for row in body.splitlines() if row.startswith("| `")}


def summary(rows: list[str]) -> list[str]:
    """The median and worst errors of the rows' own planned / measured ratios."""
    errors = {"tokens/s": [], "memory": []}
    for row in rows:
        cells = _cells(row)
        if cells[5].startswith("x"):
            errors["tokens/s"].append(abs(float(cells[5][1:]) - 1))
        if cells[8].startswith("x"):
            errors["memory"].append(abs(float(cells[8][1:]) - 1))
    return [
        f"- {name}: median error {100 * statistics.median(errs):.0f}%, worst "
        f"{100 * max(errs):.0f}% over "
        f"{len(errs)} points"
        for name, errs in errors.items()
        if errs
    ]


HEADER = [
    "| source | configuration | GPUs | measured tokens/s per GPU | planned | planned / measured "
    "| measured memory (max reserved) | planned | planned / measured |",
    "|---|---|---|---:|---:|---:|---:|---:|---:|",
]


def table(points: list[Point], log, kept: dict[str, str] | None = None) -> list[str]:
    """The table of ``points``, each planned now unless ``kept`` holds its row (by label)."""
    rows = [kept[p.label] if kept and p.label in kept else point_row(p, log) for p in points]
    return HEADER + rows + [""] + summary(rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--docs",
        action="store_true",
        help="write the table into docs/benchmarks/planner.md between its markers "
        "(with --only: replan those rows, keep the others)",
    )
    parser.add_argument(
        "--only",
        action="append",
        help="points whose 'file: label' matches this glob (e.g. '*table 1*'); repeat for more",
    )
    parser.add_argument("--list", action="store_true", help="list the points and exit")
    args = parser.parse_args()
    points = [
        p
        for p in POINTS
        if not args.only or any(fnmatch.fnmatch(p.key, glob) for glob in args.only)
    ]
    if args.list:
        print("\n".join(p.key for p in points))
        return 0

    def log(message: str) -> None:
        print(f"[plan_calibration] {message}", file=sys.stderr, flush=True)

    if not args.docs:
        print("\n".join(table(points, log)))
        return 0
    page = REPO / "docs" / "benchmarks" / "planner.md"
    kept = _rows_by_label(_page_block(page.read_text())[1])
    missing = [p.key for p in POINTS if p.label not in kept and p not in points]
    if missing:
        raise SystemExit(
            f"docs/benchmarks/planner.md has no row for {missing[0]}: plan every point (no "
            "--only) first"
        )
    planned = {p.label: point_row(p, log) for p in points}
    # The page is read again only now, so that what changed in it while the points were planned
    # (another run's rows included) is kept.
    before, old, after = _page_block(page.read_text())
    if args.only:
        # the other points keep their rows (and the stamp says which were planned when)
        rows = table(POINTS, log, {**_rows_by_label(old), **planned})
        globs = ", ".join(f"`{glob}`" for glob in args.only)
        stamp = "\n".join(
            [
                line
                for line in old.splitlines()
                if line.startswith("_Planned")
                or (
                    line.startswith("_Rows matching")
                    and not line.startswith(f"_Rows matching {globs} ")
                )
            ]
            + [f"_Rows matching {globs} planned {datetime.date.today()}._"]
        )
    else:
        rows = table(POINTS, log, planned)
        stamp = f"_Planned {datetime.date.today()} with `scripts/plan_calibration.py`._"
    write_atomic(
        page,
        before + MARKERS[0] + "\n" + "\n".join(rows) + "\n\n" + stamp + "\n" + MARKERS[1] + after,
    )
    log(f"wrote {len(points)} planned points into {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
