"""A plan as a table for people and as JSON for scripts."""

from __future__ import annotations

import dataclasses
import datetime

from canon_titan.plan import calibration
from canon_titan.plan.calibration import Band, ModelKind
from canon_titan.plan.gpus import GIB
from canon_titan.plan.planner import OUTSIDE_PYTORCH_GIB, Plan

KINDS = ("matmul", "attention", "canon", "recurrence", "other")
MEASURED = "GPU-measured range"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    return str(datetime.timedelta(seconds=round(seconds)))


def carried_band(kind: ModelKind) -> Band | None:
    """The band a plan of ``kind`` prints beside its figures: None without a GPU run of that kind,
    or with every run of it planned within ``calibration.GOAL``."""
    band = calibration.band(kind)
    return None if band is None or band.within_goal else band


def _ratios(band: Band) -> str:
    return (
        f"x{band.low:.2f}"
        if f"{band.low:.2f}" == f"{band.high:.2f}"
        else f"x{band.low:.2f}-x{band.high:.2f}"
    )


def _error(band: Band) -> str:
    """How far off the plan is: '19-35% fast', '4-9% slow', '2% slow to 14% fast'."""
    low, high = (100 * (band.low - 1), 100 * (band.high - 1))
    if low >= 0:
        return (
            f"{low:.0f}% fast" if f"{low:.0f}" == f"{high:.0f}" else f"{low:.0f}-{high:.0f}% fast"
        )
    if high < 0:
        return (
            f"{-high:.0f}% slow"
            if f"{low:.0f}" == f"{high:.0f}"
            else f"{-high:.0f}-{-low:.0f}% slow"
        )
    return f"{-low:.0f}% slow to {high:.0f}% fast"


def banded(value: float, band: Band | None, show, per_time: bool = False) -> str:
    """`` (GPU-measured range: A to B)``: ``value`` (a time, or with ``per_time`` a rate) as the
    measured runs of its kind had it; "" without a band."""
    if band is None:
        return ""
    low, high = band_range(value, band, per_time)
    return f" ({MEASURED}: {show(low)} to {show(high)})"


def band_lines(kind: ModelKind) -> list[str]:
    """What canon-titan's own GPU runs of ``kind`` say of the plan's time."""
    band = calibration.band(kind)
    head = f"Plan error ({kind.describe()}): "
    if band is None:
        known = [p.time_ratio for p in calibration.in_use() if p.planned_tokens_per_s is not None]
        return [
            head
            + "no canon-titan GPU run of this kind yet, so it is unknown"
            + (
                f" (runs of other kinds took x{min(known):.2f}-x{max(known):.2f} the planned time; "
                "docs/benchmarks/planner.md)"
                if known
                else ""
            )
        ]
    if band.within_goal:
        head += (
            f"within {100 * calibration.GOAL:.0f}% of its {len(band.points)} GPU run(s) "
            f"({_ratios(band)} the "
            "planned time)"
        )
    else:
        head += (
            f"its GPU runs took {_ratios(band)} the planned time (the plan "
            f"{_error(band)}); each {MEASURED} "
            f"above is the planned figure with that error, until every run is planned within "
            f"{100 * calibration.GOAL:.0f}%"
        )
    return [head + ":"] + [
        f"  {p.label} ({p.gpu.upper()}, {p.date}): {p.measured_tokens_per_s:,.0f} tokens/s "
        "measured, "
        f"{p.planned_tokens_per_s:,.0f} planned (x{p.time_ratio:.2f})"
        for p in band.points
    ]


def band_dict(kind: ModelKind) -> dict:
    band = calibration.band(kind)
    return {
        "kind": dataclasses.asdict(kind),
        "goal": calibration.GOAL,
        "time_ratio": None if band is None else [band.low, band.high],
        "within_goal": None if band is None else band.within_goal,
        "runs": []
        if band is None
        else [
            {
                "label": p.label,
                "gpu": p.gpu,
                "measured_on": p.measured_on,
                "measured_tokens_per_second": p.measured_tokens_per_s,
                "planned_tokens_per_second": p.planned_tokens_per_s,
                "time_ratio": p.time_ratio,
            }
            for p in band.points
        ],
    }


def band_range(value: float, band: Band | None, per_time: bool = False) -> list[float] | None:
    """``value`` (a time, or with ``per_time`` a rate) as the measured runs of its kind had it
    (None without a band)."""
    if band is None:
        return None
    return (
        [value / band.high, value / band.low] if per_time else [value * band.low, value * band.high]
    )


def _table(labels: list[str], columns: list[list[str]]) -> list[str]:
    width = max(len(label) for label in labels)
    widths = [max(len(v) for v in col) for col in columns]
    return [
        f"  {label:<{width}}  " + "  ".join(f"{col[r]:>{w}}" for col, w in zip(columns, widths))
        for r, label in enumerate(labels)
    ]


def text(plan: Plan) -> str:
    par = plan.parallel
    out = [
        f"canon-titan plan: {plan.config} ({plan.model}, {plan.param_count / 1e9:.2f}B parameters)"
        + (f" {' '.join(plan.overrides)}" if plan.overrides else ""),
        f"{plan.gpus} x {plan.gpu.name}, {plan.gpus_per_node} per node; dp_replicate "
        f"{par['dp_replicate']} x "
        f"dp_shard {par['dp_shard']} x cp {par['cp']} x tp {par['tp']} x pp {par['pp']}",
        f"batch: {plan.local_batch} x {plan.seq_len} tokens per GPU, global "
        f"{plan.global_batch} sequences "
        f"({plan.tokens_per_step / 1e6:.2f}M tokens), {plan.accumulation} accumulation "
        "group(s); compile "
        f"{'on' if plan.compiled else 'off'}; activation checkpointing "
        f"{plan.activation_checkpoint}",
        "",
    ]
    header = [k.role + (f" (rank {k.rank})" if len(plan.kinds) > 1 else "") for k in plan.kinds]

    out.append("Memory per GPU at the step's peak")
    labels = [
        "",
        "peak during",
        "parameters",
        "gradients",
        "optimizer state",
        "activations",
        "rest (buffers, FSDP buffers, allocator)",
        "PyTorch reserved (the log's memory:)",
        "+ CUDA context, NCCL, workspaces",
        f"total of {plan.gpu.memory_gib:.1f} GiB",
        "verdict",
    ]
    columns = []
    for kind, name in zip(plan.kinds, header):
        b = kind.breakdown()
        spare = plan.gpu.memory_bytes - kind.device_bytes
        columns.append(
            [
                name,
                kind.memory.phase,
                _gib(b["parameters"]),
                _gib(b["gradients"]),
                _gib(b["optimizer state"]),
                _gib(b["activations"]),
                _gib(b["rest"]),
                _gib(kind.reserved_bytes),
                _gib(OUTSIDE_PYTORCH_GIB * GIB),
                _gib(kind.device_bytes),
                f"fits, {_gib(spare)} spare" if spare >= 0 else f"DOES NOT FIT by {_gib(-spare)}",
            ]
        )
    out += _table(labels, columns) + [""]

    out.append("FLOPs per GPU per step (executed; recomputation included)")
    labels = [""] + list(KINDS) + ["total", "model FLOPs (the trainer's MFU count)"]
    columns = []
    for kind, name in zip(plan.kinds, header):
        flops = kind.time.executed_flops
        col = [name]
        col += [f"{kind.time.flops_by_kind.get(k, 0) / 1e12:.1f} TFLOP" for k in KINDS]
        col += [f"{flops / 1e12:.1f} TFLOP", f"{kind.model_flops / 1e12:.1f} TFLOP"]
        columns.append(col)
    out += _table(labels, columns) + [""]

    out.append("Collectives per GPU per step")
    for kind, name in zip(plan.kinds, header):
        if len(plan.kinds) > 1:
            out.append(f"  {name}")
        if not kind.time.collectives:
            out.append("    none")
        for c in kind.time.collectives:
            ranks = str(c.ranks) if c.ranks else "?"
            out.append(
                f"    {c.kind:<15} {c.group:<13} {ranks:>5} ranks  {c.link:<8} {c.count:>6} x  "
                f"{_bytes(c.bytes):>11}  {c.seconds * 1e3:9.1f} ms"
            )
    out.append("")

    out.append("Time per step")
    labels = [""] + [f"compute: {k}" for k in KINDS] + ["exposed communication", "this rank's step"]
    columns = []
    for kind, name in zip(plan.kinds, header):
        t = kind.time
        columns.append(
            [name]
            + [f"{t.compute_s.get(k, 0.0) * 1e3:.1f} ms" for k in KINDS]
            + [f"{t.exposed_comm_s * 1e3:.1f} ms", f"{t.step_s * 1e3:.1f} ms"]
        )
    out += _table(labels, columns)
    if plan.bubble_s:
        out.append(f"  pipeline bubble: {plan.bubble_s * 1e3:.1f} ms")
    band = carried_band(plan.model_kind)
    out += [
        f"  step: {plan.step_s:.3f} s{banded(plan.step_s, band, lambda v: f'{v:.3f} s')}",
        "",
        f"Throughput: {plan.tokens_per_s_per_gpu:,.0f} tokens/s per GPU"
        f"{banded(plan.tokens_per_s_per_gpu, band, lambda v: f'{v:,.0f}', per_time=True)}, "
        f"MFU {100 * plan.mfu:.1f}% ({plan.flops_per_token / 1e9:.2f} GFLOP per token, the "
        "trainer's count, "
        f"against {plan.gpu.bf16_tflops:.0f} TFLOP/s bf16)",
        f"Run: {plan.steps:,} steps in "
        f"{_duration(plan.wall_s)}{banded(plan.wall_s, band, _duration)} on "
        f"{plan.gpus} GPUs = {plan.gpu_hours:,.0f} "
        f"GPU-hours{banded(plan.gpu_hours, band, lambda v: f'{v:,.0f}')} "
        f"({plan.steps * plan.tokens_per_step / 1e12:.2f}T tokens)",
        *band_lines(plan.model_kind),
        "",
    ]
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    out.append(
        f"Verdict: {verdict} on {plan.gpu.name} ({_gib(plan.worst.device_bytes)} of "
        f"{plan.gpu.memory_gib:.1f} GiB on the fullest GPU)"
    )
    if not plan.fits:
        if plan.advice:
            out.append("Changes that fit (each planned):")
            for label, candidate in plan.advice:
                out.append(
                    f"  {label}: {_gib(candidate.worst.device_bytes)}, "
                    f"{candidate.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU "
                    f"{100 * candidate.mfu:.1f}%"
                )
        else:
            out.append(
                "No single change tried (activation checkpointing, a smaller local batch, "
                "TP or PP) makes it "
                "fit; use more GPUs per model replica or a smaller model"
            )
    out += ["Notes:"] + [f"  - {n}" for n in plan.notes] + [f"(planned in {plan.planner_s:.1f} s)"]
    return "\n".join(out)


def as_dict(plan: Plan) -> dict:
    def rank(kind) -> dict:
        return {
            "role": kind.role,
            "rank": kind.rank,
            "memory": {
                "peak_phase": kind.memory.phase,
                **kind.breakdown(),
                "allocated_peak": kind.memory.total,
                "reserved_peak": kind.reserved_bytes,
                "device_total": kind.device_bytes,
                "fits": kind.device_bytes <= plan.gpu.memory_bytes,
                "margin": plan.gpu.memory_bytes - kind.device_bytes,
            },
            "state_bytes": kind.state_bytes,
            "flops": {
                "executed": kind.time.executed_flops,
                "model": kind.model_flops,
                "by_kind": dict(kind.time.flops_by_kind),
            },
            "collectives": [
                {
                    "kind": c.kind,
                    "group": c.group,
                    "ranks": c.ranks,
                    "link": c.link,
                    "count": c.count,
                    "bytes": c.bytes,
                    "seconds": c.seconds,
                }
                for c in kind.time.collectives
            ],
            "time": {
                "compute": kind.time.compute_s,
                "exposed_communication": kind.time.exposed_comm_s,
                "step": kind.time.step_s,
                "kernels": kind.time.kernels,
            },
        }

    band = carried_band(plan.model_kind)
    return {
        "config": plan.config,
        "model": plan.model,
        "overrides": plan.overrides,
        "gpu": dataclasses.asdict(plan.gpu),
        "gpus": plan.gpus,
        "gpus_per_node": plan.gpus_per_node,
        "parallel": plan.parallel,
        "local_batch": plan.local_batch,
        "seq_len": plan.seq_len,
        "accumulation": plan.accumulation,
        "global_batch": plan.global_batch,
        "tokens_per_step": plan.tokens_per_step,
        "compile": plan.compiled,
        "activation_checkpoint": plan.activation_checkpoint,
        "attention_backend": plan.attention,
        "parameters": plan.param_count,
        "ranks": [rank(k) for k in plan.kinds],
        "step_seconds": plan.step_s,
        "step_seconds_measured_band": band_range(plan.step_s, band),
        "bubble_seconds": plan.bubble_s,
        "tokens_per_second_per_gpu": plan.tokens_per_s_per_gpu,
        "tokens_per_second_per_gpu_measured_band": band_range(
            plan.tokens_per_s_per_gpu, band, per_time=True
        ),
        "mfu": plan.mfu,
        "flops_per_token": plan.flops_per_token,
        "steps": plan.steps,
        "wall_seconds": plan.wall_s,
        "wall_seconds_measured_band": band_range(plan.wall_s, band),
        "gpu_hours": plan.gpu_hours,
        "gpu_hours_measured_band": band_range(plan.gpu_hours, band),
        "plan_error": band_dict(plan.model_kind),
        "fits": plan.fits,
        "margin_bytes": plan.margin_bytes,
        "reserved_peak_gib": plan.worst.reserved_bytes / GIB,
        "notes": plan.notes,
        "planner_seconds": plan.planner_s,
        "advice": [
            {
                "change": label,
                "device_total": c.worst.device_bytes,
                "tokens_per_second_per_gpu": c.tokens_per_s_per_gpu,
                "mfu": c.mfu,
            }
            for label, c in plan.advice
        ],
    }
