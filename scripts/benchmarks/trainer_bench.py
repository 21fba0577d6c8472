"""The benchmarks' trainer runs: one real training job (torchrun, TorchTitan's trainer, the built-in
corpus) per case, its figures read back from the TensorBoard scalars TorchTitan's metrics write.
Imported by bench_canon.py and bench_linear.py (this folder is first on their sys.path)."""

from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from canon_titan.components.metrics import LOSS_TAG, read_all_scalars

REPO = Path(__file__).resolve().parents[2]
BASE_CONFIG = REPO / "train_configs" / "llama_debug.toml"
METRICS = {
    "tokens_per_s": "throughput(tps)",
    "mfu_pct": "mfu(%)",
    "peak_reserved_gib": "memory/max_reserved(GiB)",
    "peak_active_gib": "memory/max_active(GiB)",
}


def run_case(
    model: dict,
    dump: str,
    *,
    seq_len: int,
    batch: int,
    steps: int,
    warmup: int,
    compile: bool,
    nproc: int = 1,
    extra: tuple[str, ...] = (),
    profile: bool = False,
) -> dict:
    """Train ``model`` (``[model]`` keys: name, flavor, overrides; ``extra``: more
    ``--section.key=value`` overrides) for ``steps`` steps; medians of the metrics over the steps
    after ``warmup``, the first step's time (compilation and autotuning included), the loss at every
    step, and the kernel choices the run logged. ``profile``: two more steps, the last under torch's
    profiler (left out of the medians), and its kernels summed by name (``profile_summary``)."""
    # Profiled: step steps + 1 warms the profiler up, step steps + 2 is recorded.
    overrides = [
        f"--training.seq_len={seq_len}",
        f"--training.local_batch_size={batch}",
        f"--training.steps={steps + 2 if profile else steps}",
        "--training.global_batch_size=-1",
        f"--lr_scheduler.warmup_steps={min(10, steps - 1)}",
        "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=true",
        "--checkpoint.enable=false",
        f"--job.dump_folder={dump}",
        f"--compile.enable={'true' if compile else 'false'}",
    ]
    overrides += [f"--model.{key}={json.dumps(value)}" for key, value in model.items()] + list(
        extra
    )
    if torch.cuda.is_available():
        overrides += ["--training.dtype=bfloat16", "--training.mixed_precision_param=bfloat16"]
    if profile:
        overrides += [
            "--profiling.enable_profiling=true",
            f"--profiling.profile_freq={steps + 2}",
            "--profiling.profiler_warmup=1",
            "--profiling.profiler_active=1",
        ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "canon_titan.train",
        "--config",
        str(BASE_CONFIG),
        *overrides,
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, WANDB_MODE="offline")
    )
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(
            f"{model['name']} at seq {seq_len} failed (exit {proc.returncode}):\n{log[-4000:]}"
        )

    scalars = read_all_scalars(dump)
    result = {
        "model": model["name"],
        "seq_len": seq_len,
        "batch": batch,
        "nproc": nproc,
        "config": str(BASE_CONFIG),
        "overrides": overrides,
    }
    for name, tag in METRICS.items():
        values = [v for step, v in scalars.get(tag, {}).items() if warmup < step <= steps]
        result[name] = statistics.median(values) if values else float("nan")
    first_tps = scalars.get(METRICS["tokens_per_s"], {}).get(1)
    result["first_step_s"] = batch * seq_len / first_tps if first_tps else float("nan")
    result["losses"] = {k: v for k, v in scalars.get(LOSS_TAG, {}).items() if k <= steps}
    if profile:
        traces = sorted(Path(dump).rglob("rank0_trace.json*"))
        result["profile_summary"] = profile_summary(traces[-1]) if traces else "no trace written"
    # The families log their kernel choice: "... backend triton (requested auto)".
    result["kernels"] = "; ".join(
        line.split(" - INFO - ", 1)[-1]
        for line in log.splitlines()
        if "(requested " in line and " - INFO - " in line
    )
    return result


KERNEL_KINDS = (
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul")),
    ("attention", ("flash", "fmha", "attn")),
    ("canon (triton)", ("_canon",)),
    ("collective", ("nccl",)),
    ("torch (copies, optimizer)", ("at::native",)),
    ("inductor (fused)", ("triton_",)),
    ("fla / mamba (triton)", ("chunk", "fwd_kernel", "bwd_kernel")),
)


def profile_summary(trace: Path, top: int = 12) -> dict:
    """One profiled step's GPU kernels (on a CPU its ops instead, nested ones counted in their
    callers
    too: only a check of the plumbing): total milliseconds, the share of
    each kind (GEMMs, attention, Canon, collectives, torch's own kernels, Inductor's fused kernels,
    fla and mamba's kernels, the rest) and the ``top`` kernels by time."""
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        kernels = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"] / 1000
    total = sum(by_name.values())
    kinds: dict[str, float] = {}
    for name, ms in by_name.items():
        low = name.lower()
        kind = next((k for k, needles in KERNEL_KINDS if any(n in low for n in needles)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "total_ms": round(total, 3),
        "kinds_ms": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_ms": [[name[:120], round(ms, 3)] for name, ms in ranked],
        "host": host_summary(events),
    }


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
"""The CUDA runtime and driver calls that launch a kernel (Triton's launcher calls the driver's; the
profiler files driver calls under ``cuda_driver``, runtime calls under ``cuda_runtime``)."""


def host_summary(events: list[dict]) -> dict:
    """What the host did in the profiled step, where a GPU step's idle time comes from: the step's
    span on the host (TorchTitan's ``ProfilerStep#N``), the kernel launches (count and time in the
    launch calls), and each of canon-titan's custom ops (``canon_titan::*``: the Canon op, the fla
    and mamba-ssm wrappers; calls and time, their launches included, and the launches made inside
    them: how much of a custom op's host time is its kernels' launching, and how much the Python
    around it)."""
    step = [
        e["dur"]
        for e in events
        if str(e.get("name", "")).startswith("ProfilerStep#") and "dur" in e
    ]
    launches = [
        e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and e.get("name") in LAUNCHES
        and "dur" in e
    ]
    ops: dict[str, list[dict]] = {}
    for e in events:
        if (
            e.get("cat") == "cpu_op"
            and str(e.get("name", "")).startswith("canon_titan::")
            and "dur" in e
        ):
            ops.setdefault(e["name"], []).append(e)

    def inside(calls: list[dict]) -> list[float]:
        """The launches' times made on a call's thread within its span."""
        spans = [(c.get("tid"), c["ts"], c["ts"] + c["dur"]) for c in calls if "ts" in c]
        return [
            launch["dur"]
            for launch in launches
            if "ts" in launch
            and any(
                tid == launch.get("tid") and start <= launch["ts"] <= end
                for tid, start, end in spans
            )
        ]

    def op(calls: list[dict]) -> dict:
        made = inside(calls)
        return {
            "calls": len(calls),
            "ms": round(sum(c["dur"] for c in calls) / 1000, 3),
            "launches": len(made),
            "launch_ms": round(sum(made) / 1000, 3),
        }

    return {
        "step_ms": round(max(step) / 1000, 3) if step else None,
        "launches": len(launches),
        "launch_ms": round(sum(launch["dur"] for launch in launches) / 1000, 3),
        "custom_ops": {
            name: op(calls)
            for name, calls in sorted(ops.items(), key=lambda kv: -sum(c["dur"] for c in kv[1]))
        },
    }
