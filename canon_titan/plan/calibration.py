"""canon-titan's own GPU runs against what the planner predicts for them, and the error band a plan
carries from them.

Each ``Point`` is one training run of the trainer measured on one GPU (``scripts/gpu_check.sh``: a
1B recipe's model on the built-in data, its 784-token vocabulary, compile, no activation
checkpointing; tokens/s the median of steps 5-12). A configuration measured again later is judged
by its newest run (``in_use``). What the planner predicts for each run in use is stored in
``PLANNED_FILE`` (planning them all takes minutes): ``scripts/benchmarks/plan_recipes.py --docs``
plans them and writes it, and ``tests/test_plan_output.py`` plans each again and fails when the
planner has moved away from it. A plan's time and GPU-hour figures carry the range of measured
against planned time over the runs in use of its kind of model (``ModelKind``, ``band``), until
every one of them is within ``GOAL``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from canon_titan.tools.fileio import write_atomic

GOAL = 0.10
"""A kind of model whose every run the plan predicts within this fraction needs no band."""


@dataclass(frozen=True)
class ModelKind:
    """What sets a run's kernels apart: the model family, float8's recipe ("" without float8), and
    whether a custom op was forced onto its torch backend (``auto`` picks the CUDA kernels)."""

    model: str
    float8: str = ""
    torch_kernels: bool = False

    def describe(self) -> str:
        return f"{self.model}, {f'float8 {self.float8}' if self.float8 else 'bf16'}" + (
            ", torch kernels" if self.torch_kernels else ""
        )


def kind_of(run, float8: str | None = None) -> ModelKind:
    """The kind of a resolved run (``float8``: a recipe name, or "" for none, in place of the
    run's)."""
    model = run["model"]
    if float8 is None:
        float8 = run["float8"]["recipe_name"] if run["float8"]["enable"] else ""
    torch_kernels = "torch" in (model.get("canon_backend"), model.get("kernel_backend"))
    return ModelKind(model["name"], float8, torch_kernels)


@dataclass(frozen=True)
class Point:
    label: str
    recipe: str
    """A file of ``train_configs/``, without ``.toml``."""
    overrides: tuple[str, ...]
    gpu: str
    kind: ModelKind
    measured_tokens_per_s: float
    measured_gib: float | None
    """Peak reserved memory (None: the session kept only the speed)."""
    measured_on: str
    """The session's date (ISO), then its GPU and software."""
    expandable_segments: bool = False
    """The CUDA allocator's mode the run had (its reserved memory depends on it;
    ``plan(expandable=)``): the runs of 2026-11-22 to 28 ran without expandable segments, which no
    launcher set before 2026-11-29."""

    @property
    def date(self) -> str:
        return self.measured_on[:10]

    @property
    def key(self) -> str:
        return f"{self.label} | {self.gpu} | {self.measured_on}"

    @property
    def planned_tokens_per_s(self) -> float | None:
        """The planner's figure for the run (``PLANNED_FILE``: the runs in use only)."""
        return planned().get(self.key)

    @property
    def time_ratio(self) -> float:
        """The measured step time over the planned one."""
        return self.planned_tokens_per_s / self.measured_tokens_per_s


def _shape(local_batch: int, seq_len: int = 4096) -> tuple[str, ...]:
    return (
        "--training.local_batch_size",
        str(local_batch),
        "--training.global_batch_size",
        str(local_batch),
        "--training.seq_len",
        str(seq_len),
        "--model.vocab_size",
        "784",
    )


BF16 = ("--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16")
"""bf16 weights and optimizer state: the benchmarks' setting on one GPU, where no FSDP casts fp32
weights."""
TRITON = ("--model.canon_backend", "triton")
TENSORWISE = ("--float8.enable", "true", "--float8.recipe_name", "tensorwise")
ROWWISE = ("--float8.enable", "true", "--float8.recipe_name", "rowwise")
LLAMA, CANON, MAMBA2 = (
    "Llama-1B-Nemo-1T-lr0.003",
    "LlamaCanon-1B-Nemo-1T-lr0.003",
    "Mamba2Canon-1B-Nemo-1T-lr0.003",
)
MAMBA_SSM = ("--model.kernel_backend", "mamba_ssm")

POINTS = (
    # the offline GPU kit's table (shared/gpu/README.md), the recipe's fp32 weights
    Point(
        "Llama-1B",
        LLAMA,
        _shape(2),
        "h100",
        ModelKind("llama"),
        45_200,
        33.4,
        "2026-11-22, H100, torch 2.11",
    ),
    Point(
        "LlamaCanon-1B, torch Canon backend",
        CANON,
        (*_shape(2), "--model.canon_backend", "torch"),
        "h100",
        ModelKind("llama_canon", torch_kernels=True),
        33_400,
        46.3,
        "2026-11-22, H100, torch 2.11",
    ),
    # scripts/gpu_check.sh on one H200, the Canon backward kernels before their rewrite
    Point(
        "Llama-1B, bf16 weights",
        LLAMA,
        (*_shape(2), *BF16),
        "h200",
        ModelKind("llama"),
        48_527,
        25.5,
        "2026-11-26, H200, torch 2.11",
    ),
    Point(
        "LlamaCanon-1B, Triton Canon op, bf16 weights",
        CANON,
        (*_shape(2), *TRITON, *BF16),
        "h200",
        ModelKind("llama_canon"),
        33_402,
        26.3,
        "2026-11-26, H200, torch 2.11",
    ),
    Point(
        "LlamaCanon-1B, Triton Canon op, bf16 weights, float8 tensorwise",
        CANON,
        (*_shape(2), *TRITON, *BF16, *TENSORWISE),
        "h200",
        ModelKind("llama_canon", "tensorwise"),
        32_111,
        25.1,
        "2026-11-26, H200, torch 2.11",
    ),
    Point(
        "LlamaCanon-1B, Triton Canon op, bf16 weights, float8 rowwise",
        CANON,
        (*_shape(2), *TRITON, *BF16, *ROWWISE),
        "h200",
        ModelKind("llama_canon", "rowwise"),
        25_056,
        25.1,
        "2026-11-26, H200, torch 2.11",
    ),
    # the same, the Canon backward kernels rewritten; leftover processes of an earlier step shared
    # the host (docs/benchmarks/gpu.md). The linear recipes train at 16384: measured, and planned,
    # at 4096.
    Point(
        "Llama-1B, bf16 weights",
        LLAMA,
        (*_shape(2), *BF16),
        "h200",
        ModelKind("llama"),
        42_158,
        25.5,
        "2026-11-27, H200, torch 2.11",
    ),
    Point(
        "LlamaCanon-1B, Triton Canon op, bf16 weights",
        CANON,
        (*_shape(2), *TRITON, *BF16),
        "h200",
        ModelKind("llama_canon"),
        35_580,
        26.3,
        "2026-11-27, H200, torch 2.11",
    ),
    Point(
        "Mamba2Canon-1B, mamba-ssm SSD kernel, bf16 weights",
        MAMBA2,
        (*_shape(2), *MAMBA_SSM, *BF16),
        "h200",
        ModelKind("mamba2"),
        32_683,
        27.4,
        "2026-11-27, H200, torch 2.11",
    ),
    Point(
        "GDN2Canon-1B, torch recurrence kernel, bf16 weights",
        "GDN2Canon-1B-Nemo-1T-lr0.003",
        (*_shape(2), "--model.kernel_backend", "torch", *BF16),
        "h200",
        ModelKind("gdn2", torch_kernels=True),
        9_091,
        63.0,
        "2026-11-27, H200, torch 2.11",
    ),
    # scripts/gpu_lease.sh (one gpu_check.sh run across the lease's two calls): the same kit and
    # kernels, a host of its own; the 16k runs at batch 1
    Point(
        "Llama-1B, bf16 weights",
        LLAMA,
        (*_shape(2), *BF16),
        "h200",
        ModelKind("llama"),
        45_904,
        25.5,
        "2026-11-28, H200, torch 2.11",
    ),
    Point(
        "LlamaCanon-1B, Triton Canon op, bf16 weights",
        CANON,
        (*_shape(2), *TRITON, *BF16),
        "h200",
        ModelKind("llama_canon"),
        38_004,
        26.2,
        "2026-11-28, H200, torch 2.11",
    ),
    Point(
        "LlamaCanon-1B, Triton Canon op, bf16 weights, float8 tensorwise",
        CANON,
        (*_shape(2), *TRITON, *BF16, *TENSORWISE),
        "h200",
        ModelKind("llama_canon", "tensorwise"),
        31_422,
        25.1,
        "2026-11-28, H200, torch 2.11",
    ),
    Point(
        "LlamaCanon-1B, Triton Canon op, bf16 weights, float8 rowwise",
        CANON,
        (*_shape(2), *TRITON, *BF16, *ROWWISE),
        "h200",
        ModelKind("llama_canon", "rowwise"),
        32_922,
        25.1,
        "2026-11-28, H200, torch 2.11",
    ),
    Point(
        "Mamba2Canon-1B, mamba-ssm SSD kernel, bf16 weights",
        MAMBA2,
        (*_shape(2), *MAMBA_SSM, *BF16),
        "h200",
        ModelKind("mamba2"),
        19_189,
        27.4,
        "2026-11-28, H200, torch 2.11",
    ),
    Point(
        "Llama-1B at 16384, batch 1, bf16 weights",
        LLAMA,
        (*_shape(1, 16384), *BF16),
        "h200",
        ModelKind("llama"),
        35_294,
        39.6,
        "2026-11-28, H200, torch 2.11",
    ),
    Point(
        "Mamba2Canon-1B at 16384, batch 1, mamba-ssm SSD kernel, bf16 weights",
        MAMBA2,
        (*_shape(1, 16384), *MAMBA_SSM, *BF16),
        "h200",
        ModelKind("mamba2"),
        42_759,
        43.7,
        "2026-11-28, H200, torch 2.11",
    ),
    # the second lease of 2026-11-28: the 1B recipes' own local batch (issue 79)
    Point(
        "Llama-1B at 8 x 4096, bf16 weights",
        LLAMA,
        (*_shape(8), *BF16),
        "h200",
        ModelKind("llama"),
        56_733,
        67.6,
        "2026-11-28, H200, torch 2.11",
    ),
    Point(
        "LlamaCanon-1B at 8 x 4096, Triton Canon op, bf16 weights",
        CANON,
        (*_shape(8), *TRITON, *BF16),
        "h200",
        ModelKind("llama_canon"),
        48_786,
        71.0,
        "2026-11-28, H200, torch 2.11",
    ),
)


PLANNED_FILE = Path(__file__).resolve().parents[1] / "assets" / "plan_calibration.json"


@functools.cache
def planned() -> dict[str, float]:
    """Point key -> the planner's tokens/s for that run, as ``PLANNED_FILE`` stores them."""
    return json.loads(PLANNED_FILE.read_text()) if PLANNED_FILE.is_file() else {}


def write_planned(figures: dict[str, float]) -> None:
    write_atomic(PLANNED_FILE, json.dumps(dict(sorted(figures.items())), indent=1) + "\n")
    planned.cache_clear()


def in_use(points=None) -> list[Point]:
    """The newest run of each configuration (recipe, overrides, GPU) of ``points`` (default
    ``POINTS``)."""
    newest: dict[tuple, Point] = {}
    for point in POINTS if points is None else points:
        key = (point.recipe, point.overrides, point.gpu)
        if key not in newest or point.date >= newest[key].date:
            newest[key] = point
    return list(newest.values())


@dataclass(frozen=True)
class Band:
    """The measured time over the planned one, lowest and highest, over a kind's runs."""

    points: tuple[Point, ...]

    @property
    def low(self) -> float:
        return min(p.time_ratio for p in self.points)

    @property
    def high(self) -> float:
        return max(p.time_ratio for p in self.points)

    @property
    def within_goal(self) -> bool:
        return all(abs(p.time_ratio - 1) <= GOAL for p in self.points)


def band(kind: ModelKind, points=None) -> Band | None:
    """The band of ``kind`` over the points in use of ``points`` (default ``POINTS``; None: no GPU
    run of that kind)."""
    mine = tuple(p for p in in_use(points) if p.kind == kind and p.planned_tokens_per_s is not None)
    return Band(mine) if mine else None
