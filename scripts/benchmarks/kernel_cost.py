#!/usr/bin/env python
"""A GPU's cost of each Triton kernel a training step launches, read from the compiled kernels on
this CPU (``canon_titan/plan/kernel_cost.py``: SASS counted by ``canon_titan/kernels/sass.py``).

canon       every Canon kernel of a LlamaCanon-1B layer at --batch x --seq-len (8 x 4096): SASS
            per element by class, registers, bytes, memory- against issue-bound time, per step
inductor    Inductor's kernels of a compiled LlamaCanon-1B block (generated for sm_90 here)
linear      the recurrence and Canon kernels of GLA5/GDN2/Mamba2-1B at 16,384 x 1
first-step  every kernel configuration the linear models' first step compiles and times (after
            kernels/tuning.py's narrowing), each compiled for sm_90 here: the compile time
leases      predicted against measured for every GPU lease that timed kernels, the kernels as they
            were then (git show of their commit)
guard       the figures tests/test_kernel_cost_guard.py holds (with CANON_TITAN_FULL_AUTOTUNE=1:
            each forward call's fastest candidate too)
predict     what the next lease's block sweeps of the Canon kernels (backward and forward) should
            time

    .venv/bin/python scripts/benchmarks/kernel_cost.py canon
    .venv/bin/python scripts/benchmarks/kernel_cost.py leases --json out.json

Unset TRITON_INTERPRET (it compiles for a GPU). Compiled code is cached
(``kernel_cost.cache_folder``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from canon_titan.plan import kernel_cost, kernel_counts  # noqa: E402

GPU = "h200"
LAYERS = 24
"""The 1B flavors' layers."""


def _gpu():
    from canon_titan.plan.gpus import GPUS

    return GPUS[GPU]


# ------------------------------------------------------------------------------------- calls


def _without_newer_arguments(function):
    """An older commit's Canon entry point called by today's layer: the keyword arguments it does
    not take (document positions, CP halos, added since) dropped when they have today's default."""
    import inspect

    from canon_titan.kernels import canon as today

    taken = inspect.signature(function).parameters
    defaults = inspect.signature(getattr(today, function.__name__)).parameters

    def call(*args, **kwargs):
        for name in [k for k in kwargs if k not in taken]:
            if name not in defaults or kwargs[name] != defaults[name].default:
                raise TypeError(f"{function.__qualname__} of that commit takes no {name}")
            del kwargs[name]
        return function(*args, **kwargs)

    return call


def model_calls(
    family: str, batch: int, seq_len: int, overrides: dict | None = None, canon_module=None
) -> list[tuple[str, list]]:
    """One layer's custom-op calls of ``family``'s 1B flavor, forward and backward, at batch x
    seq_len (meta tensors, the CUDA backends as on an H100/H200); with ``canon_module``, the Canon
    entry points of that module (another commit's kernels, ``old_canon``) in place of today's."""
    import torch

    import model_registry
    from canon_titan.kernels.backends import KernelEnvironment, planned_machine
    from canon_titan.models.common import canon as canon_layer

    namespace = "canon_titan"
    saved = canon_layer.canon_conv, canon_layer.canon_swiglu
    if canon_module is not None:
        canon_layer.canon_conv, canon_layer.canon_swiglu = (
            _without_newer_arguments(canon_module.canon_conv),
            _without_newer_arguments(canon_module.canon_swiglu),
        )
        namespace = canon_module.NAMESPACE
    try:
        with planned_machine(KernelEnvironment.planned_gpu((9, 0))):
            config = model_registry.model_spec(
                family, "1B", {"n_layers": 1, **(overrides or {})}
            ).model
            with torch.device("meta"):
                model = config.build()
            model.to(torch.bfloat16)

            def step():
                model(
                    torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
                ).float().sum().backward()

            calls = kernel_counts.calls_of(step, namespace)
            if canon_module is not None:  # the recurrences are today's
                calls = kernel_counts.calls_of(step, "canon_titan") + calls
    finally:
        canon_layer.canon_conv, canon_layer.canon_swiglu = saved
    return calls


def old_canon(commit: str):
    """``canon_titan/kernels/canon.py`` at ``commit`` as a module of its own, its custom ops in a
    namespace of their own (``canon_<commit>``), from a file in a temporary folder."""
    source = subprocess.run(
        ["git", "show", f"{commit}:canon_titan/kernels/canon.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    namespace = f"canon_{commit}"
    source = source.replace('"canon_titan::', f'"{namespace}::').replace(
        "torch.ops.canon_titan.", f"torch.ops.{namespace}."
    )
    folder = Path(tempfile.mkdtemp(prefix="kernel-cost-"))
    path = folder / f"{namespace}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(namespace, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[namespace] = module
    spec.loader.exec_module(module)
    module.NAMESPACE = namespace
    return module


def counted(calls: list[tuple[str, list]]) -> list[tuple[str, list, list[list]]]:
    """Each call with its launches' configurations counted (in this process; cached)."""
    out = []
    for op, args in calls:
        costs = kernel_counts.cached(op, args)
        if costs is None:
            costs = kernel_counts.count_call(op, args)
        out.append((op, args, costs))
    return out


def _elements(args: list) -> int:
    import math

    first = next(a for a in args if isinstance(a, list) and a and a[0] == "tensor")
    return math.prod(first[1])


def _variant(op: str, args: list) -> str:
    """A Canon call as the review's table names it."""
    name = op.split("::")[1]
    flags = [a for a in args if isinstance(a, bool)]
    scaled = any(
        isinstance(a, list)
        and a
        and a[0] == "tensor"
        and len(a[1]) == 2
        and a[1][0] > 1
        and a[4] == "float32"
        for a in args
    )
    width = next(a[1][-1] for a in args if isinstance(a, list) and a and a[0] == "tensor")
    parts = [name, f"{width} ch"]
    if scaled:
        parts.append("fused norm")
    if flags and flags[-1] and "swiglu" not in name and "weight_grads" not in name:
        parts.append("SiLU")
    return ", ".join(parts)


def rows_of(calls_counted, gpu, layers: int = LAYERS) -> list[dict]:
    """One row per kernel launch kind: calls per layer, its best configuration's figures, per
    step."""
    given = kernel_cost.assumptions(gpu)
    full = kernel_cost.Assumptions(memory=given.memory, issue=1.0, tensor=1.0)
    rows: dict[tuple, dict] = {}
    for op, args, costs in calls_counted:
        for configs in costs:
            if not configs:
                continue
            chosen = kernel_cost.best(configs, gpu, given)
            count = chosen.count
            perfect = kernel_cost.priced(count, gpu, full)
            key = (_variant(op, args), count.kernel, count.config)
            row = rows.setdefault(
                key,
                {
                    "call": key[0],
                    "kernel": count.kernel,
                    "config": count.config,
                    "calls": 0,
                    "registers": count.registers,
                    "spill_bytes": count.spill_bytes,
                    "elements": 0,
                    "executed": defaultdict(float),
                    "bytes": 0,
                    "memory_s": 0.0,
                    "issue_full_s": 0.0,
                    "issue_s": 0.0,
                    "tensor_s": 0.0,
                    "s": 0.0,
                    "mma_flops": 0.0,
                },
            )
            row["calls"] += 1
            row["elements"] += _elements(args)
            for cls, n in count.executed.items():
                row["executed"][cls] += n
            row["bytes"] += count.bytes
            row["memory_s"] += chosen.memory_s
            row["issue_full_s"] += perfect.issue_s
            row["issue_s"] += chosen.issue_s
            row["tensor_s"] += chosen.tensor_s
            row["mma_flops"] += count.mma_flops
            row["s"] += chosen.seconds
    out = []
    for row in rows.values():
        per = {cls: 32 * n / row["elements"] for cls, n in row["executed"].items()}
        out.append(
            {
                **row,
                "executed": dict(row["executed"]),
                "per_element": per,
                "sass_per_element": sum(per.values()),
                "step_bytes": layers * row["bytes"],
                "step_memory_ms": 1e3 * layers * row["memory_s"],
                "step_issue_full_ms": 1e3 * layers * row["issue_full_s"],
                "step_issue_ms": 1e3 * layers * row["issue_s"],
                "step_tensor_ms": 1e3 * layers * row["tensor_s"],
                "step_ms": 1e3 * layers * row["s"],
                "bound": max(
                    (
                        ("memory", row["memory_s"]),
                        ("issue", row["issue_s"]),
                        ("tensor", row["tensor_s"]),
                    ),
                    key=lambda b: b[1],
                )[0],
            }
        )
    return out


def md(*cells) -> str:
    """A Markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


ROW_HEADER = [
    "call (per layer)",
    "kernel",
    "config",
    "registers",
    "SASS per element",
    "int / fp32 / MUFU per element",
    "HBM GB a step",
    "memory-bound ms",
    "issue-bound ms (100%)",
    "issue ms",
    "tensor ms",
    "predicted ms",
    "bound",
]


def print_rows(title: str, rows: list[dict]) -> None:
    gpu = _gpu()
    given = kernel_cost.assumptions(gpu)
    print(
        f"\n{title}: {gpu.name}, {gpu.sm_count} SMs at {gpu.sm_clock_ghz} GHz; memory at "
        f"{given.memory:.0%} of {gpu.hbm_tb_s} TB/s, issue at {given.issue:.0%} of the schedulers' "
        f"cycles (also at 100%), tensor cores at {given.tensor:.0%} of the bf16 peak; per step of "
        f"{LAYERS} layers"
    )
    print(md(*ROW_HEADER))
    print(md("---", "---", "---", *["---:"] * 9, "---"))
    for r in rows:
        p = r["per_element"]
        classes = f"{p.get('int', 0):.1f} / {p.get('fp32', 0):.1f} / {p.get('mufu', 0):.1f}"
        print(
            md(
                f"{r['call']} (x{r['calls']})",
                f"`{r['kernel']}`",
                r["config"] or "fixed",
                r["registers"],
                f"{r['sass_per_element']:.1f}",
                classes,
                f"{r['step_bytes'] / 1e9:.1f}",
                f"{r['step_memory_ms']:.2f}",
                f"{r['step_issue_full_ms']:.2f}",
                f"{r['step_issue_ms']:.2f}",
                f"{r['step_tensor_ms']:.2f}",
                f"{r['step_ms']:.2f}",
                r["bound"],
            )
        )

    def total(key: str, scale: float = 1.0) -> str:
        return f"{sum(r[key] for r in rows) * scale:.1f}"

    print(
        md(
            "**all**",
            "",
            "",
            "",
            "",
            "",
            total("step_bytes", 1e-9),
            total("step_memory_ms"),
            total("step_issue_full_ms"),
            total("step_issue_ms"),
            total("step_tensor_ms"),
            f"**{total('step_ms')}**",
            "",
        )
    )


# ------------------------------------------------------------------------------------- tables


def table_canon(args) -> dict:
    calls = [
        c
        for c in model_calls("llama_canon", args.batch, args.seq_len, {"canon_backend": "triton"})
        if "canon_" in c[0]
    ]
    rows = rows_of(counted(calls), _gpu())
    print_rows(f"Canon kernels of LlamaCanon-1B at {args.batch} x {args.seq_len}", rows)
    return {"rows": rows}


INDUCTOR_TOKENS = 1024
"""Inductor's kernels are generated at 1 x 1024 and scaled to the step's tokens: a compiled block's
pointwise and row kernels do per token what they do at 4096 (the attention, whose CPU kernel runs
for real here, is an extern kernel and not among them)."""


def inductor_launches(family: str = "llama_canon") -> list:
    """Every Triton kernel launch of one compiled 1B block's forward and backward (the step after
    the compiling one), as ``sass.Launch``es of Inductor's kernels and configurations, generated for
    sm_90 on this CPU and not run (``inductor_bytes.HopperCodegen``)."""
    import torch
    import triton
    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.runtime.triton_heuristics import GridExpr

    import model_registry
    from canon_titan.kernels import canon, sass

    sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
    from inductor_bytes import HopperCodegen

    HopperCodegen()
    launches: list = []

    def run(autotuner, *args, **kwargs):
        configs = list(autotuner.configs)
        tuned = triton.autotune(configs=configs, key=[])(autotuner.fn)
        meta = autotuner.inductor_meta
        names = autotuner.fn.arg_names

        def grid(values, meta=meta, configs=configs):
            chosen = {k: values[k] for k in configs[0].kwargs if k in values}
            return GridExpr.from_meta(meta, chosen).eval_slow(values)

        launches.append(sass.Launch(tuned, grid, args[: len(names)], {}))

    triton_heuristics.CachingAutotuner.run = run
    canon._use_triton = lambda backend, x, size: (
        backend == "triton" and size in canon.TRITON_KERNEL_SIZES
    )
    overrides = {"n_layers": 1, "max_seq_len": INDUCTOR_TOKENS}
    if family == "llama_canon":
        overrides["canon_backend"] = "triton"
    spec = model_registry.model_spec(family, "1B", overrides)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        block = spec.model.build().layers["0"]
    finally:
        torch.set_default_dtype(default)
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(1, INDUCTOR_TOKENS, spec.model.dim, dtype=torch.bfloat16)

    def step():
        y = compiled(x.clone().requires_grad_())
        y.backward(torch.ones_like(y))

    step()
    launches.clear()
    step()
    return [launch for launch in launches if not launch.name.startswith("_canon")]


def table_inductor(args) -> dict:
    """Inductor's kernels of a compiled LlamaCanon-1B block (and Llama-1B's, for the difference),
    scaled to --batch x --seq-len."""
    gpu = _gpu()
    given = kernel_cost.assumptions(gpu)
    full = kernel_cost.Assumptions(memory=given.memory, issue=1.0, tensor=1.0)
    codes = kernel_counts.Codes(kernel_counts.cache_folder())
    tokens = args.batch * args.seq_len / INDUCTOR_TOKENS
    out = {}
    for family in ("llama_canon", "llama"):
        rows = []
        for launch in inductor_launches(family):
            counts = kernel_counts.launch_counts(launch, codes)
            cost = kernel_cost.best(counts, gpu, given)
            perfect = kernel_cost.priced(cost.count, gpu, full)
            # each of the layers' launches at the step's tokens: the bounds scale, the floor does
            # not
            seconds = max(cost.memory_s, cost.issue_s, cost.tensor_s) * tokens
            rows.append(
                {
                    "kernel": cost.count.kernel,
                    "config": cost.count.config,
                    "registers": cost.count.registers,
                    "bytes": cost.count.bytes * tokens * LAYERS,
                    "memory_ms": 1e3 * cost.memory_s * tokens * LAYERS,
                    "issue_full_ms": 1e3 * perfect.issue_s * tokens * LAYERS,
                    "ms": 1e3 * max(seconds, kernel_cost.MIN_KERNEL_S) * LAYERS,
                    "bound": cost.bound,
                    "matched": cost.count.matched,
                }
            )
        out[family] = rows
        print(
            f"\nInductor's kernels of a compiled {family} 1B block (generated at 1 x "
            f"{INDUCTOR_TOKENS}, per step of {args.batch} x {args.seq_len} and {LAYERS} layers), "
            f"{gpu.name}\n"
        )
        print(
            md(
                "kernel",
                "config",
                "registers",
                "HBM GB a step",
                "memory-bound ms",
                "issue-bound ms (100%)",
                "predicted ms",
                "bound",
            )
        )
        print(md("---", "---", *["---:"] * 5, "---"))
        for r in rows:
            name = f"`{r['kernel']}`" + ("" if r["matched"] else " (loops by memory)")
            print(
                md(
                    name,
                    r["config"],
                    r["registers"],
                    f"{r['bytes'] / 1e9:.2f}",
                    f"{r['memory_ms']:.2f}",
                    f"{r['issue_full_ms']:.2f}",
                    f"{r['ms']:.2f}",
                    r["bound"],
                )
            )
        print(
            md(
                f"**{len(rows)} kernels**",
                "",
                "",
                f"{sum(r['bytes'] for r in rows) / 1e9:.1f}",
                f"{sum(r['memory_ms'] for r in rows):.1f}",
                f"{sum(r['issue_full_ms'] for r in rows):.1f}",
                f"**{sum(r['ms'] for r in rows):.1f}**",
                "",
            )
        )
    return out


LINEAR = {
    "gla5": {"kernel_backend": "fla"},
    "gdn2": {"kernel_backend": "fla"},
    "mamba2": {"kernel_backend": "mamba_ssm"},
}


def table_linear(args) -> dict:
    out = {}
    for family, overrides in LINEAR.items():
        calls = model_calls(family, 1, 16384, {**overrides, "canon_backend": "triton"})
        rows = rows_of(counted(calls), _gpu())
        print_rows(f"{family.upper()}-1B at 1 x 16,384", rows)
        out[family] = rows
    return out


def table_first_step(args) -> dict:
    """Every configuration the first step's autotuners compile and time, per family, compiled
    here."""
    out = {}
    for family, overrides in LINEAR.items():
        calls = model_calls(family, 1, 16384, {**overrides, "canon_backend": "triton"})
        seen, kernels = set(), []
        for op, _call_args, costs in counted(calls):
            for configs in costs:
                for c in configs:
                    if c.compile_key in seen:
                        continue
                    seen.add(c.compile_key)
                    kernels.append(
                        {
                            "op": op,
                            "kernel": c.kernel,
                            "config": c.config,
                            "compile_s": c.compile_s,
                            "autotuned": len(configs) > 1,
                        }
                    )
        total = sum(k["compile_s"] for k in kernels)
        tuned = sum(1 for k in kernels if k["autotuned"])
        print(
            f"\n{family.upper()}-1B at 1 x 16,384: {len(kernels)} kernel configurations compiled "
            f"({tuned} of them autotuning candidates), {total:.0f} s of compiling on this machine"
        )
        print("| op | kernel | configuration | compile s |")
        print("|---|---|---|---:|")
        for k in kernels:
            print(
                md(
                    k["op"].split("::")[1],
                    f"`{k['kernel']}`",
                    k["config"] or "fixed",
                    f"{k['compile_s']:.1f}",
                )
            )
        out[family] = {"kernels": kernels, "compile_s": total}
    return out


# ------------------------------------------------------------------------------------- guard


def guard_figures(pinned: dict[str, str] | None = None) -> dict[str, list]:
    """Per Canon call of a LlamaCanon-1B layer at 8 x 4096 (``_variant``): its kernel, the
    configuration it runs with (``pinned``'s, the only one compiled, where it names one; else the
    fastest by the instrument, every candidate compiled), its SASS instructions per element and its
    issue-bound time at 100% over its memory-bound time. ``tests/test_kernel_cost_guard.py`` holds
    them."""
    gpu = _gpu()
    given = kernel_cost.assumptions(gpu)
    full = kernel_cost.Assumptions(memory=given.memory, issue=1.0, tensor=1.0)
    codes = kernel_counts.Codes(kernel_counts.cache_folder())
    out: dict[str, list] = {}
    calls = model_calls("llama_canon", 8, 4096, {"canon_backend": "triton"})
    for op, args in calls:
        variant = _variant(op, args)
        if variant in out:
            continue
        (launch,) = kernel_counts.launches(op, args)
        configs = launch.configs()
        wanted = (pinned or {}).get(variant)
        if wanted is not None:
            chosen = [c for c in configs if c.label == wanted]
            if not chosen:
                raise SystemExit(
                    f"{variant}: its launch has no configuration {wanted!r} (it has "
                    f"{[c.label for c in configs]}): update FIGURES"
                )
            configs = chosen
        launch.configs = lambda configs=configs: configs
        counts = kernel_counts.launch_counts(launch, codes)
        cost = kernel_cost.best(counts, gpu, given)
        at_full = kernel_cost.priced(cost.count, gpu, full)
        per_element = cost.count.per_element(_elements(args))
        out[variant] = [
            cost.count.kernel,
            cost.count.config,
            round(per_element, 2),
            round(at_full.issue_s / at_full.memory_s, 3),
        ]
    return out


def table_guard(args) -> dict:
    figures = guard_figures()
    print("FIGURES = {")
    for variant, (kernel, config, per_element, ratio) in figures.items():
        print(f"    {variant!r}: ({kernel!r}, {config!r}, {per_element}, {ratio}),")
    print("}")
    return figures


# ------------------------------------------------------------------------------------- leases


# What the H200 leases measured of the Triton kernels (docs/benchmarks/gpu.md): the kernels of the
# commit each ran, the run, and per kernel (a name, or a kind: all Canon kernels, the SSD
# recurrence's) the profiled step's milliseconds. The 2026-11-27 block sweep timed the Canon
# backward kernels alone, one call at batch 2 x 4096 and the configurations named (its milliseconds
# include the weight-gradient sum after the kernel); the issue efficiency is fitted to its rows at
# the configuration then kept (in sample).
PROFILED = [
    (
        "2026-11-26",
        "4e8742d",
        "llama_canon",
        2,
        4096,
        {"_canon_swiglu_bwd_kernel": 32.5, "_canon_bwd_kernel": 26.6, "forward kernels": 6.7},
    ),
    (
        "2026-11-27",
        "4a3653d",
        "llama_canon",
        2,
        4096,
        {"_canon_swiglu_bwd_kernel": 13.7, "Canon": 29.7},
    ),
    ("2026-11-27", "4a3653d", "mamba2", 2, 4096, {"Canon": 28.3, "recurrence": 24.7}),
    ("2026-11-28", "913c6aa", "llama_canon", 2, 4096, {"Canon": 28.5}),
    ("2026-11-28", "913c6aa", "mamba2", 2, 4096, {"Canon": 27.9, "recurrence": 24.7}),
    ("2026-11-28", "913c6aa", "mamba2", 1, 16384, {"Canon": 54.6, "recurrence": 47.3}),
]
SWEPT = [  # (call, blocks, ms)
    ("Canon-A", (16, 32, 4), 0.071),
    ("Canon-A", (16, 64, 4), 0.094),
    ("Canon-D", (16, 32, 4), 0.584),
    ("Mamba2 b", (16, 32, 4), 0.293),
]
SWEEP_COMMIT = "4a3653d"
FAMILY_OVERRIDES = {
    "llama_canon": {"canon_backend": "triton"},
    "mamba2": {"canon_backend": "triton", "kernel_backend": "mamba_ssm"},
}


def _swept_launches(module, call: str, blocks):
    """The block sweep's calls (``canon_op_bench.backward_blocks``) at batch 2 x 4096: Canon-A's
    through ``conv_weight_grads`` where the module has it (the input's gradient is Inductor's since
    605baf9), else ``conv_backward``."""
    import torch

    from canon_titan.kernels import sass

    def meta(*shape, width=None, dtype=torch.bfloat16):
        return torch.empty(*shape[:-1], width or shape[-1], dtype=dtype, device="meta")[
            ..., : shape[-1]
        ]

    block_t, block_c, warps = blocks
    chosen = {"BLOCK_T": block_t, "BLOCK_C": block_c, "num_warps": warps}
    module.BACKWARD_BLOCKS = module.RECOMPUTING_BACKWARD_BLOCKS = chosen
    b, t = 2, 4096

    def run():
        if call == "Canon-A":
            scales = meta(b, t, dtype=torch.float32), meta(2048)
            module.conv_backward(
                meta(b, t, 2048), meta(b, t, 2048), meta(2048, 4), None, *scales, True, False
            )
        elif call == "Canon-D":
            module.swiglu_backward(
                meta(b, t, 5632),
                meta(b, t, 5632),
                meta(b, t, 5632),
                meta(11264, 4),
                None,
                True,
                False,
            )
        else:  # Mamba2-1B's short convolution over x|B|C: 4352 channels of in_proj's 8464
            module.conv_backward(
                meta(b, t, 4352),
                meta(b, t, 4352, width=8464),
                meta(4352, 4),
                meta(4352),
                None,
                None,
                False,
                True,
            )

    return sass.record_launches(run)


def _kind_ms(rows: list[dict], kind: str) -> float:
    if kind == "Canon":
        return sum(r["step_ms"] for r in rows if r["kernel"].startswith("_canon"))
    if kind == "recurrence":
        return sum(r["step_ms"] for r in rows if not r["kernel"].startswith("_canon"))
    if kind == "forward kernels":
        return sum(
            r["step_ms"] for r in rows if r["kernel"].startswith("_canon") and "fwd" in r["kernel"]
        )
    return sum(r["step_ms"] for r in rows if r["kernel"] == kind)


def fit_issue_efficiency() -> tuple[float, list[dict]]:
    """The issue efficiency that the sweep's rows at the kept blocks (16x32/4w) measured: the
    geometric mean of their issue-bound time at 100% over their time."""
    import math

    gpu = _gpu()
    module = old_canon(SWEEP_COMMIT)
    codes = kernel_counts.Codes(kernel_counts.cache_folder())
    full = kernel_cost.Assumptions(
        memory=kernel_cost.assumptions(gpu).memory, issue=1.0, tensor=1.0
    )
    rows = []
    for call, blocks, ms in SWEPT:
        costs = [
            kernel_cost.priced(kernel_counts.launch_counts(launch, codes)[0], gpu, full)
            for launch in _swept_launches(module, call, blocks)
        ]
        rows.append(
            {
                "call": call,
                "blocks": "{}x{}/{}w".format(*blocks),
                "measured_ms": ms,
                "memory_ms": 1e3 * sum(c.memory_s for c in costs),
                "issue_full_ms": 1e3 * sum(c.issue_s for c in costs),
                "registers": max(c.count.registers for c in costs),
                "fitted": blocks == (16, 32, 4),
            }
        )
    fitted = [r for r in rows if r["fitted"]]
    efficiency = math.exp(
        sum(math.log(r["issue_full_ms"] / r["measured_ms"]) for r in fitted) / len(fitted)
    )
    return efficiency, rows


def canon_ms(commit: str | None, family: str, batch: int, seq_len: int) -> float:
    """The predicted milliseconds of the Canon kernels of a step of ``family``'s 1B flavor at batch
    x seq_len, the kernels of ``commit`` (None: today's)."""
    module = old_canon(commit) if commit else None
    calls = model_calls(family, batch, seq_len, FAMILY_OVERRIDES[family], canon_module=module)
    canon = [c for c in calls if c[0].split("::")[1].startswith("canon_")]
    return _kind_ms(rows_of(counted(canon), _gpu()), "Canon")


def table_predict(args) -> dict:
    """What the next lease's block sweeps (``bench_canon.py --mode bwd_blocks`` and ``fwd_blocks``,
    one call alone at 2 x 4096, 1B widths) should time with today's kernels: each call at each
    candidate configuration, predicted before the run; * marks the fixed one."""
    import canon_op_bench as bench
    from canon_titan.kernels import canon, sass

    gpu = _gpu()
    given = kernel_cost.assumptions(gpu)
    codes = kernel_counts.Codes(kernel_counts.cache_folder())
    batch, seq = 2, 4096
    names = {"conv": "BACKWARD_BLOCKS", "swiglu": "SWIGLU_BACKWARD_BLOCKS"}
    fixed = {name: getattr(canon, name) for name in ("FORWARD_BLOCKS", *names.values())}

    def predicted(sweep: str, call, run, blocks: dict, current: bool) -> dict:
        costs = [
            kernel_cost.best(kernel_counts.launch_counts(launch, codes), gpu, given)
            for launch in sass.record_launches(run)
        ]
        label = bench.forward_label(blocks) if sweep == "forward" else bench.backward_label(blocks)
        return {
            "sweep": sweep,
            "call": call.name,
            "blocks": label + (" *" if current else ""),
            "registers": max(c.count.registers for c in costs),
            "memory_ms": 1e3 * sum(c.memory_s for c in costs),
            "predicted_ms": 1e3 * sum(c.seconds for c in costs),
        }

    rows = []
    try:
        for call in bench.swept_calls("backward", "1B"):
            meta = bench.inputs(call, batch, seq, "meta")
            dy = meta["x"].new_empty(batch, seq, call.channels)
            name = names["swiglu" if call.swiglu else "conv"]
            for block_c, unroll, warps in bench.BACKWARD_CANDIDATES:
                blocks = {**fixed[name], "BLOCK_C": block_c, "U": unroll, "num_warps": warps}
                setattr(canon, name, blocks)
                run = bench._backward(call, meta, dy, bodies=True)
                rows.append(predicted("backward", call, run, blocks, blocks == fixed[name]))
            setattr(canon, name, fixed[name])
        for call in bench.swept_calls("forward", "1B"):
            meta = bench.inputs(call, batch, seq, "meta")
            for blocks in bench.forward_candidates():
                canon.FORWARD_BLOCKS = blocks
                run = bench._forward(call, meta)
                current = blocks == fixed["FORWARD_BLOCKS"]
                rows.append(predicted("forward", call, run, blocks, current))
    finally:
        for name, blocks in fixed.items():
            setattr(canon, name, blocks)
    print(
        md(
            "sweep",
            "call (one, batch 2 x 4096)",
            "blocks",
            "registers",
            "memory-bound ms",
            "predicted ms",
        )
    )
    print(md("---", "---", "---", "---:", "---:", "---:"))
    for r in rows:
        print(
            md(
                r["sweep"],
                r["call"],
                r["blocks"],
                r["registers"],
                f"{r['memory_ms']:.3f}",
                f"{r['predicted_ms']:.3f}",
            )
        )
    return {"sweep": rows}


def table_leases(args) -> dict:
    gpu = _gpu()
    given = kernel_cost.assumptions(gpu)
    efficiency, swept = fit_issue_efficiency()
    print(
        f"\nIssue efficiency the 2026-11-27 sweep measured (its 16x32/4w rows): {efficiency:.3f} "
        f"(kernel_cost.ASSUMPTIONS has {given.issue})\n"
    )
    print(
        md(
            "lease",
            "kernels",
            "call (one, batch 2 x 4096)",
            "blocks",
            "registers",
            "memory-bound ms",
            "issue-bound ms (100%)",
            "predicted ms",
            "measured ms",
            "predicted / measured",
            "sample",
        )
    )
    print(md("---", "---", "---", "---", *["---:"] * 6, "---"))
    for r in swept:
        predicted = max(r["memory_ms"], r["issue_full_ms"] / given.issue)
        r["predicted_ms"] = predicted
        print(
            md(
                "2026-11-27 sweep",
                SWEEP_COMMIT,
                r["call"],
                r["blocks"],
                r["registers"],
                f"{r['memory_ms']:.3f}",
                f"{r['issue_full_ms']:.3f}",
                f"{predicted:.3f}",
                f"{r['measured_ms']:.3f}",
                f"x{predicted / r['measured_ms']:.2f}",
                "in (fitted)" if r["fitted"] else "out",
            )
        )
    print()
    print(
        md(
            "lease",
            "kernels",
            "run",
            "kernels timed",
            "memory-bound ms",
            "issue-bound ms (100%)",
            "predicted ms",
            "measured ms",
            "predicted / measured",
            "sample",
        )
    )
    print(md("---", "---", "---", "---", *["---:"] * 5, "---"))
    profiled = []
    for date, commit, family, batch, seq_len, measured in PROFILED:
        module = old_canon(commit)
        calls = model_calls(family, batch, seq_len, FAMILY_OVERRIDES[family], canon_module=module)
        rows = rows_of(counted(calls), gpu)
        for kind, ms in measured.items():
            predicted = _kind_ms(rows, kind)
            memory = sum(r["step_memory_ms"] for r in rows if _kind_ms([r], kind))
            issue = sum(r["step_issue_full_ms"] for r in rows if _kind_ms([r], kind))
            label = f"{family} 1B, {batch} x {seq_len}"
            profiled.append(
                {
                    "date": date,
                    "commit": commit,
                    "run": label,
                    "kind": kind,
                    "memory_ms": memory,
                    "issue_full_ms": issue,
                    "predicted_ms": predicted,
                    "measured_ms": ms,
                }
            )
            print(
                md(
                    date,
                    commit,
                    label,
                    kind,
                    f"{memory:.1f}",
                    f"{issue:.1f}",
                    f"{predicted:.1f}",
                    f"{ms:.1f}",
                    f"x{predicted / ms:.2f}",
                    "out",
                )
            )
    return {"efficiency_fitted": efficiency, "swept": swept, "profiled": profiled}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "table",
        choices=("canon", "inductor", "linear", "first-step", "leases", "guard", "predict"),
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(
            "kernel_cost.py: unset TRITON_INTERPRET (it compiles the kernels for a GPU)",
            file=sys.stderr,
        )
        return 2
    if args.table != "inductor":  # which compiles with Inductor: it asks the device about itself
        kernel_counts._as_hopper()
    started = time.perf_counter()
    result = {
        "canon": table_canon,
        "linear": table_linear,
        "first-step": table_first_step,
        "leases": table_leases,
        "guard": table_guard,
        "predict": table_predict,
        "inductor": table_inductor,
    }[args.table](args)
    print(f"\n({time.perf_counter() - started:.0f} s on this machine)", file=sys.stderr)
    if args.json:
        from canon_titan.tools.fileio import write_atomic

        write_atomic(args.json, json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
