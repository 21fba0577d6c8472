#!/usr/bin/env python
"""Everything a lent GPU should measure, in one run, ordered by value so that a run cut short still
brings back the figures that matter most. Each step is a subprocess under its own time limit
(``timeout -s INT``, so a hang prints where it was and costs only its step; KILL 15 s later), all
within ``--budget`` seconds; a step that no longer fits is skipped and named. After every step the
report is rewritten, so a run killed from outside keeps what it measured. Run it through
``scripts/gpu_check.sh OUTDIR``, which installs the offline kit first where needed.

  env                 GPU, driver, torch/triton/fla/mamba-ssm versions, the kernel backends
      ``auto`` picks
  kernel_tests        the kernel tests on CUDA (five pytest shards side by side)             } side
      by
  losses              bf16 loss curves, 100 steps: llama_canon triton vs torch, gla5 fla vs  } side
                      torch, mamba2 mamba_ssm vs torch (debug models, the trainer), each pair  }
                      as it ends                                                            }
  warm_tuning         two untimed steps of Mamba2-1B and GLA5-1B at 16,384 x 1, so that their }
                      kernels are tuned and compiled (on disk) before their timed runs      }
  syncs               what a training step waits on (step_syncs.py): sync debug mode and the }
                      profiler's CUDA runtime calls, pinned vs pageable batches, and PP 2     }
                      (PP 2 x FSDP 2 on four GPUs) where two GPUs are lent
  canon_llama_b8      the trainer, one run each (TorchTitan's metrics; 1B, seq 4096, the recipes'
      batch 8,
  canon_triton_b8       compile, a profiled step): Llama-1B, then LlamaCanon-1B on the Triton Canon
      op: the
                        Canon ratio of record
  canon_llama         the same at batch 2 (the base of the linear and float8 runs)
  canon_triton
  linear_*_16k        the linear models' figure of record: Llama, Mamba2, GLA5, GDN2 (Canon AbbCD)
      at the
                      recipes' 16,384 x 1, then Mamba2 with CUDA graphs, then the three with
                      document masking (against the same runs without); a case whose recurrence
                      ``auto`` runs on torch here is skipped, saying why
  linear_*_4k         Mamba2, GLA5, GDN2 at 4096 x 2, for information (against canon_llama)
  float8_tensorwise   LlamaCanon-1B (triton) with float8 training, each recipe (against
      canon_triton)
  float8_rowwise
  canon_bwd_blocks    the Canon backward kernels at each candidate block configuration (bench_canon
                      --mode bwd_blocks: the fixed blocks are chosen from it)
  canon_fwd_blocks    the same of the forward kernels (--mode fwd_blocks: the fixed FORWARD_BLOCKS
                      against the other candidates of FORWARD_CONFIGS)
  float8_gemms        a Llama block's float8 GEMMs as torchao's recipes run them, against bf16, at
      the
                      shapes of the planner's TP 8 calibration points and of LlamaCanon-1B
                          (bench_float8_gemm)
  ops                 the Canon ops against fla's causal_conv1d and the memory bound (bench_canon
      --mode ops)
  cp_attention        one context-parallel rank's attention at TorchTitan's table 2 shapes, torch's
      ring and
                      canon-titan's gather, compute alone (cp_attention_rank: issue 42's CP 4 and 8
                          points)
  canon_torch         LlamaCanon-1B on the torch Canon backend (the first baseline's configuration)
Beside each trainer run, the planner's prediction (``canon-titan plan`` for that GPU), when time is
left at the end; ``--replan OUTDIR`` adds them afterwards on any machine.

Writes OUTDIR/gpu_check.md (tables), gpu_check.json (everything) and gpu_check.log (every step's
output). ``--tiny`` runs a step of each kind at toy size on the CPU, in Triton's interpreter: a
check that the script works, not a measurement (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from canon_titan.tools.fileio import write_atomic
from gpu_check_report import markdown

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).resolve())


@dataclass
class Step:
    name: str
    limit: int
    """Seconds."""
    command: list[str]
    group: str = ""
    """Steps of one group run side by side (correctness checks: their timings do not matter)."""
    result: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """One trainer run of the report: ``table`` and ``base`` (the case it is compared with) place
    it."""

    name: str
    table: str
    label: str
    model: dict
    seq: int
    batch: int
    base: str | None = None
    extra: tuple[str, ...] = ()
    tiny: bool = False
    """Also run by --tiny."""
    limit: int = 150
    kernel_op: str | None = None
    """The recurrence op the case measures (``backends.CUDA_BACKENDS``): skipped where ``auto``
    would run it on the torch fallback, which is not what the case is for."""


TRAINER_STEPS, TRAINER_WARMUP = 12, 4
"""Medians over steps 5-12: the first steps compile and autotune."""
TINY = {"flavor": "debug", "seq": 32, "batch": 1, "steps": 2, "warmup": 1}
LINEAR = ("mamba2", "gla5", "gdn2")
"""In the order they run at each length. GLA5's first step once had no known bound (fla's full
autotuning, docs/benchmarks/gpu.md) and ran last; fla's searches are now narrowed and tuned before
the first collective (``canon_titan/kernels/tuning.py``), and GLA5 runs with the others."""
LINEAR_OPS = {"mamba2": "ssd", "gdn2": "gated_delta_rule", "gla5": "gla"}


def cases() -> list[Case]:
    """Every trainer run, in the order they run (by value)."""
    llama = {"name": "llama", "flavor": "1B"}
    canon = {"name": "llama_canon", "flavor": "1B", "canon_set": "ABCD"}
    # The figure of record at the 1B recipes' own batch, 8 x 4096 (it fits an H200:
    # docs/benchmarks/gpu.md), then batch 2, the base of the linear and float8 runs.
    out = [
        Case("canon_llama_b8", "canon", "llama, batch 8", llama, 4096, 8, limit=120),
        Case(
            "canon_triton_b8",
            "canon",
            "llama_canon (triton), batch 8",
            {**canon, "canon_backend": "triton"},
            4096,
            8,
            base="canon_llama_b8",
            limit=120,
        ),
        Case("canon_llama", "canon", "llama", llama, 4096, 2),
        Case(
            "canon_triton",
            "canon",
            "llama_canon (triton)",
            {**canon, "canon_backend": "triton"},
            4096,
            2,
            base="canon_llama",
            tiny=True,
        ),
    ]
    # The linear models' figure of record first: the recipes' 16,384 x 1 against Llama at 16,384 x
    # 1; then 4096 x 2, for information.
    for seq, batch, base in ((16384, 1, "linear_llama_16k"), (4096, 2, "canon_llama")):
        tag = f"{seq // 1024}k"
        if seq != 4096:
            out.append(Case(f"linear_llama_{tag}", "linear", "llama", llama, seq, batch))
        out += [
            Case(
                f"linear_{family}_{tag}",
                "linear",
                f"{family}:AbbCD",
                {"name": family, "flavor": "1B", "canon_set": "AbbCD"},
                seq,
                batch,
                base=base,
                tiny=(family == "gla5" and seq == 4096),
                limit=180,
                kernel_op=LINEAR_OPS[family],
            )
            for family in LINEAR
        ]
        if seq != 4096:
            # Mamba2 is host-bound (its idle time at 16k: docs/benchmarks/gpu.md): the same run with
            # TorchTitan's CUDA graph of the whole forward and backward, launched at once.
            out.append(
                Case(
                    f"linear_mamba2_{tag}_graphs",
                    "linear",
                    "mamba2:AbbCD, CUDA graphs",
                    {"name": "mamba2", "flavor": "1B", "canon_set": "AbbCD"},
                    seq,
                    batch,
                    base=base,
                    extra=("--training.disable_cuda_graphs=false",),
                    limit=180,
                    kernel_op="ssd",
                )
            )
            # Packed documents kept apart (fla's varlen kernels, mamba-ssm's seq_idx, the Canon
            # layers' taps inside each document) against the same run without: the built-in corpus
            # packs ~190 documents a row.
            out += [
                Case(
                    f"linear_{family}_{tag}_documents",
                    "linear",
                    f"{family}:AbbCD, document masking",
                    {"name": family, "flavor": "1B", "canon_set": "AbbCD"},
                    seq,
                    batch,
                    base=f"linear_{family}_{tag}",
                    extra=("--dataloader.document_masking=true",),
                    limit=180,
                    kernel_op=LINEAR_OPS[family],
                )
                for family in LINEAR
            ]
    for recipe in ("tensorwise", "rowwise"):
        out.append(
            Case(
                f"float8_{recipe}",
                "float8",
                f"llama_canon (triton) {recipe}",
                {**canon, "canon_backend": "triton"},
                4096,
                2,
                base="canon_triton",
                extra=("--float8.enable=true", f"--float8.recipe_name={recipe}"),
                tiny=(recipe == "tensorwise"),
                limit=120,
            )
        )
    out.append(
        Case(
            "canon_torch",
            "canon",
            "llama_canon (torch)",
            {**canon, "canon_backend": "torch"},
            4096,
            2,
            base="canon_llama",
        )
    )
    return out


def steps(tiny: bool, work: Path) -> list[Step]:
    py = sys.executable
    ops = ["--flavor", "debug", "--seq-len", "32", "--batch", "1", "--reps", "1"] if tiny else []
    tiny_flag = ["--tiny"] if tiny else []
    correctness = [
        Step(
            "kernel_tests",
            120,
            [py, SCRIPT, "--kernel-tests", str(work), *tiny_flag],
            group="correctness",
        ),
        Step(
            "losses",
            120,
            [py, SCRIPT, "--losses", str(work / "losses.json"), *tiny_flag],
            group="correctness",
        ),
    ]
    if not tiny:  # nothing to tune in the interpreter, no CUDA to synchronise with
        correctness.append(
            Step(
                "warm_tuning",
                120,
                [py, SCRIPT, "--warm", str(work / "warm_tuning.json")],
                group="correctness",
            )
        )
        correctness.append(
            Step(
                "syncs",
                150,
                [py, "scripts/benchmarks/step_syncs.py", str(work / "syncs.json")],
                group="correctness",
            )
        )
    trainer = {
        c.name: Step(
            c.name,
            c.limit,
            [py, SCRIPT, "--case", c.name, str(work / f"{c.name}.json"), *tiny_flag],
        )
        for c in cases()
        if c.tiny or not tiny
    }
    ops_step = Step(
        "ops",
        120,
        [
            py,
            "scripts/benchmarks/bench_canon.py",
            "--mode",
            "ops",
            *ops,
            "--json",
            str(work / "ops.json"),
        ],
    )
    float8_gemms = Step(
        "float8_gemms",
        60,
        [
            py,
            "scripts/benchmarks/bench_float8_gemm.py",
            *tiny_flag,
            "--json",
            str(work / "float8_gemms.json"),
        ],
    )
    # Llama 3.1 8B's 8 K/V heads for canon-titan's gather: its grouped-query lower-right flash path,
    # checked against plain causal SDPA before it is timed
    cp_step = Step(
        "cp_attention",
        90,
        [
            py,
            "scripts/benchmarks/cp_attention_rank.py",
            "--kv-heads",
            "8",
            "--json",
            str(work / "cp_attention.json"),
        ],
    )
    blocks_step = Step(
        "canon_bwd_blocks",
        90,
        [
            py,
            "scripts/benchmarks/bench_canon.py",
            "--mode",
            "bwd_blocks",
            *(ops or ["--reps", "20"]),
            "--json",
            str(work / "canon_bwd_blocks.json"),
        ],
    )
    forward_blocks_step = Step(
        "canon_fwd_blocks",
        60,
        [
            py,
            "scripts/benchmarks/bench_canon.py",
            "--mode",
            "fwd_blocks",
            *(ops or ["--reps", "20"]),
            "--json",
            str(work / "canon_fwd_blocks.json"),
        ],
    )
    ordered = [Step("env", 60, [py, SCRIPT, "--env", str(work / "env.json")]), *correctness]
    # The op microbenchmarks (the Canon backward's block sweep first: it picks the fixed blocks)
    # after every trainer run but the torch-backend reference.
    return (
        ordered
        + [trainer[n] for n in trainer if n != "canon_torch"]
        + [blocks_step]
        + ([] if tiny else [forward_blocks_step])  # its own test runs it at toy sizes
        + [float8_gemms, ops_step]
        + ([] if tiny else [cp_step])  # its own test runs it at toy sizes
        + ([trainer["canon_torch"]] if "canon_torch" in trainer else [])
    )


KERNEL_TESTS = (
    ("tests/test_canon_triton.py", "-k", "real_shapes"),
    ("tests/test_canon_triton.py", "-k", "equals_torch or rmsnorm"),
    ("tests/test_canon_triton.py", "-k", "not (equals_torch or rmsnorm or real_shapes)"),
    ("tests/test_kernel_backends.py", "-k", "fla_equals_torch"),
    ("tests/test_kernel_backends.py", "-k", "not fla_equals_torch"),
    ("tests/test_canon_determinism.py",),
)
"""Shards of about equal Triton compile work (each shape of the equality tests tunes its kernels
afresh), the Canon kernels at the 1B recipes' shapes in bf16 first."""
TINY_KERNEL_TESTS = (("tests/test_canon_triton.py", "-k", "fallback"),)


WARM = ("linear_mamba2_16k", "linear_gla5_16k")
"""Cases whose kernels' autotuning and compilation the ``warm_tuning`` step does beside the
correctness checks: Mamba2's first step took 72 to 115 s and GLA5's over 124 s on an H200, mostly
mamba-ssm's and fla's Triton autotuners timing every candidate, most of it compiling them. Triton's
compiled kernels stay on disk for the timed runs later, and with ``TRITON_CACHE_AUTOTUNING`` the
choices too (not for mamba-ssm's kernels whose candidates carry a pre-hook, which Triton will not
cache: those are timed again, from compiled binaries). No tuning key holds the sequence length.
Tuned beside other work, a choice may differ from a quiet GPU's: every candidate is valid."""


def warm_tuning(path: str) -> None:
    """Two trainer steps of each ``WARM`` case, side by side, untimed; ``path`` lists those that
    finished (as each ends) and the last line of any that failed."""
    from concurrent.futures import as_completed

    import torch

    from trainer_bench import run_case

    # The timed runs' shape where the GPU holds both beside the other checks; on an 80 GB GPU a
    # quarter of the sequence (no tuning key holds it; Inductor compiles the timed shape again).
    roomy = (
        torch.cuda.is_available()
        and torch.cuda.get_device_properties(0).total_memory >= 120 * 2**30
    )

    def warm(name: str) -> str | None:
        case = next(c for c in cases() if c.name == name)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                run_case(
                    dict(case.model),
                    os.path.join(tmp, name),
                    seq_len=case.seq if roomy else case.seq // 4,
                    batch=case.batch,
                    steps=2,
                    warmup=0,
                    compile=True,
                    extra=case.extra,
                )
            except RuntimeError as e:
                return str(e).strip().splitlines()[-1]
        return None

    result: dict = {"warmed": [], "failed": {}}
    with ThreadPoolExecutor(len(WARM)) as pool:
        futures = {pool.submit(warm, name): name for name in WARM}
        for future in as_completed(futures):
            error = future.result()
            if error:
                result["failed"][futures[future]] = error
            else:
                result["warmed"].append(futures[future])
            write_atomic(path, json.dumps(result))


def kernel_tests(tiny: bool, work: Path) -> int:
    """The kernel tests, one pytest per shard side by side (their Triton compiles dominate, and the
    GPU machine has 16 cores: in one process, 26 of the 60 tests ran in 120 s on an H200), each
    writing its own JUnit file. On SIGINT (the step's limit: ``timeout`` signals the whole process
    group) each pytest stops and still writes its file; one that has not stopped 5 s later is
    interrupted again from here."""
    import signal

    files = TINY_KERNEL_TESTS if tiny else KERNEL_TESTS
    # On the GPU the kernels as the training runs them, never in the interpreter (``--tiny``: the
    # CPU's check).
    env = {k: v for k, v in os.environ.items() if tiny or k != "TRITON_INTERPRET"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest",
                *args,
                "-q",
                "-rfE",
                "-p",
                "no:cacheprovider",
                f"--junitxml={work / f'kernel_tests-{i}.xml'}",
            ],
            cwd=REPO,
            env=env,
        )
        for i, args in enumerate(files)
    ]
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        time.sleep(5)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        return 130
    return max(codes)


def torch_fallback(step_name: str, report: dict) -> str | None:
    """Why a trainer case would measure the torch fallback of its recurrence here, or None. GDN2 on
    an H200 with the kit's Triton 3.6 (fla refuses its gated-delta backward there) has its fallback
    figure on record (docs/benchmarks/gpu.md), and a run of it again measures nothing new in a short
    lease. What ``auto`` picks comes from the ``env`` step, or (``--only`` without it) from a
    process of its own: this one stays off the GPU."""
    case = next((c for c in cases() if c.name == step_name), None)
    if case is None or case.kernel_op is None:
        return None
    picks = report["steps"].get("env", {}).get("data", {}).get("auto_backends") or report.get(
        "auto_backends"
    )
    if picks is None:
        proc = subprocess.run(
            [sys.executable, SCRIPT, "--env", "-"], cwd=REPO, capture_output=True, text=True
        )
        picks = report["auto_backends"] = (
            json.loads(proc.stdout)["auto_backends"] if proc.returncode == 0 else {}
        )
    pick = picks.get(case.kernel_op, "")
    if not pick.startswith("torch"):
        return None
    return f"auto runs {case.kernel_op} on torch here" + (
        f": {pick[len('torch (') : -1]}" if pick != "torch" else ""
    )


def trainer_case(name: str, tiny: bool) -> dict:
    """Run one case of ``cases()`` in the trainer; its figures and where it sits in the report."""
    from trainer_bench import run_case

    case = next(c for c in cases() if c.name == name)
    model, extra = dict(case.model), list(case.extra)
    seq, batch, steps_, warmup = case.seq, case.batch, TRAINER_STEPS, TRAINER_WARMUP
    if tiny:
        model["flavor"] = TINY["flavor"]
        seq, batch, steps_, warmup = TINY["seq"], TINY["batch"], TINY["steps"], TINY["warmup"]
        if case.table == "float8":
            extra.append("--float8.emulate=true")
    with tempfile.TemporaryDirectory() as tmp:
        result = run_case(
            model,
            os.path.join(tmp, name),
            seq_len=seq,
            batch=batch,
            steps=steps_,
            warmup=warmup,
            compile=not tiny,
            extra=tuple(extra),
            profile=True,
        )
    return {
        **result,
        "case": name,
        "table": case.table,
        "label": case.label,
        "base": case.base,
        "canon_backend": model.get("canon_backend"),
        "steps": steps_,
        "warmup": warmup,
    }


# ----------------------------------------------------------------------------- sub-steps run by
# this script


def environment() -> dict:
    import torch
    import triton

    from canon_titan.kernels import backends

    gpu = {}
    if torch.cuda.is_available():
        gpu = {
            "gpu": torch.cuda.get_device_name(),
            "capability": "sm_%d%d" % torch.cuda.get_device_capability(),
            "memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
        }
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        gpu["driver"] = smi.stdout.strip() or smi.stderr.strip()
    packages = {"torch": torch.__version__, "triton": triton.__version__}
    for backend in ("fla", "mamba_ssm"):
        problem = backends.import_problem(backend)
        packages[backend] = problem or backends.installed_version(backend)
    chosen = {op: backends.resolve_backend("auto", op=op) for op in backends.CUDA_BACKENDS}
    # The host: a step bound by the host's work (Mamba2-1B at 4096, docs/benchmarks/gpu.md) runs at
    # its CPU's speed.
    cpuinfo = Path("/proc/cpuinfo")
    models = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text() if cpuinfo.exists() else "").splitlines()
        if line.startswith("model name")
    ]
    host = (
        f"{(models[0] if models else platform.processor()) or 'unknown CPU'}, {os.cpu_count()} "
        "cores"
    )
    return {
        **gpu,
        "host": host,
        "python": sys.version.split()[0],
        "packages": packages,
        "auto_backends": {
            op: f"{b}" + (f" ({why})" if why else "") for op, (b, why) in chosen.items()
        },
    }


LOSS_STEPS = 100
LOSS_PAIRS = [
    ("llama_canon", "canon_backend", "triton"),
    ("gla5", "kernel_backend", "fla"),
    ("mamba2", "kernel_backend", "mamba_ssm"),
]


def loss_comparison(tiny: bool, path: str) -> None:
    """Each pair trains the same debug model from the same seed with the Triton backend and with
    torch; the loss curves' largest difference. The runs go side by side; ``path`` is rewritten as
    each pair finishes (fastest first), so that a pair whose kernels take long to tune costs only
    itself."""
    from concurrent.futures import as_completed

    from trainer_bench import run_case

    # Tiny: GLA5 on fla only (the trainer steps run llama_canon's Triton kernels; mamba_ssm's
    # trainer path is fla's), one step.
    pairs = LOSS_PAIRS[1:2] if tiny else LOSS_PAIRS
    steps, seq, layers = (1, 32, 1) if tiny else (LOSS_STEPS, 256, 4)
    cases = [(name, key, backend) for name, key, cuda in pairs for backend in (cuda, "torch")]
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(cases)) as pool:
        futures = {
            pool.submit(
                run_case,
                {"name": c[0], "flavor": "debug", "n_layers": layers, c[1]: c[2]},
                os.path.join(tmp, f"{c[0]}-{c[2]}"),
                seq_len=seq,
                batch=4,
                steps=steps,
                warmup=0,
                compile=False,
            ): c
            for c in cases
        }
        runs = {}
        for future in as_completed(futures):
            name, _, backend = futures[future]
            runs[(name, backend)] = future.result()
            cuda = next(b for n, _, b in pairs if n == name)
            if (name, cuda) in runs and (name, "torch") in runs:
                out[f"{name} {cuda} vs torch"] = _loss_difference(
                    runs[(name, cuda)], runs[(name, "torch")]
                )
                write_atomic(path, json.dumps(out, indent=2))


def _loss_difference(got_run: dict, want_run: dict) -> dict:
    got, want = got_run["losses"], want_run["losses"]
    assert list(got) == list(want) and got, f"steps {list(got)} vs {list(want)}"
    diffs = [abs(got[s] - want[s]) for s in want]
    return {
        "steps": len(want),
        "first_loss": want[min(want)],
        "last_loss": want[max(want)],
        "max_abs_diff": max(diffs),
        "max_rel_diff": max(d / abs(want[s]) for d, s in zip(diffs, want)),
        "kernels": got_run["kernels"],
    }


# ----------------------------------------------------------------------------- the planner


def planner_available() -> bool:
    proc = subprocess.run(
        [sys.executable, "-m", "canon_titan.cli", "plan", "--help"], cwd=REPO, capture_output=True
    )
    return proc.returncode == 0


def predict(run: dict, gpu: str) -> dict:
    """The planner's prediction for a benchmark run (its config and overrides)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "canon_titan.cli",
            "plan",
            run["config"],
            "--gpus",
            str(run.get("nproc", 1)),
            "--gpu",
            gpu,
            "--json",
            *run["overrides"],
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(proc.stdout)


# ----------------------------------------------------------------------------- running and
# reporting


TUNED = REPO / "scripts" / "benchmarks" / "gpu_check_tuned.json"
"""Triton's autotuning results from an earlier lent GPU (``OUTDIR/triton_autotune.json`` of its run,
committed here): restored into Triton's cache before the steps run, so that the kernels of fla,
mamba-ssm and the Canon forward pick their tuned configurations without timing every candidate again
(that tuning took minutes of a short lease: docs/benchmarks/gpu.md). Triton keys each entry by
its version, the GPU architecture, the kernel's source, the tuning key and the candidates, so an
entry that does not match this machine is never read."""


def triton_cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def collect_tuning(cache: Path) -> dict:
    """Every autotuning result in Triton's cache (``<key>/<kernel>.autotune.json``), by its path
    there."""
    return {
        str(path.relative_to(cache)): path.read_text()
        for path in sorted(cache.glob("*/*.autotune.json"))
    }


def restore_tuning(files: dict, cache: Path) -> int:
    """Write ``collect_tuning``'s results into Triton's cache where absent; returns how many were
    written."""
    written = 0
    for name, text in files.items():
        path = cache / name
        if (
            Path(name).is_absolute()
            or ".." in Path(name).parts
            or not name.endswith(".autotune.json")
        ):
            raise ValueError(f"{TUNED}: {name!r} is not a file of Triton's cache")
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text)
            written += 1
    return written


STEP_MARK = "CANON_GPU_CHECK_STEP"
"""Set in every step's environment (and so in every process it starts): how its leftovers are
found."""


def leftover_processes(mark: str) -> list[int]:
    """Processes, other than this one, whose environment holds ``STEP_MARK=mark``. torchrun starts
    its workers in sessions of their own, so a trainer run stopped with its step (``timeout``
    signals one process group) can leave them behind, training on the GPU and compiling on the CPU
    through the steps that follow, which slows every later step's figures
    (docs/benchmarks/gpu.md)."""
    needle = f"{STEP_MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours
            pass
    return found


def kill_leftovers(mark: str, wait: float = 10.0) -> list[int]:
    """SIGKILL every leftover process of a step; wait until they are gone. Returns their pids."""
    import signal

    pids = leftover_processes(mark)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.perf_counter() + wait
    while leftover_processes(mark) and time.perf_counter() < deadline:
        time.sleep(0.2)
    return pids


KILL_AFTER = 15
"""Seconds between a step's interrupt at its limit and its KILL."""


def run_step(step: Step, limit: int, log) -> None:
    # The host's load as the step starts (1-minute average): what else was running beside a timed
    # run.
    step.result["load_before"] = round(os.getloadavg()[0], 2)
    started = time.perf_counter()
    mark = f"{step.name}-{os.getpid()}"
    # INT first (Python prints where it was), KILL 15 s later if it is still there. The output goes
    # to a file, not a pipe: a leftover process holding the pipe open would keep the step from
    # ending.
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.run(
            ["timeout", "-s", "INT", "-k", str(KILL_AFTER), str(limit), *step.command],
            cwd=REPO,
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **{STEP_MARK: mark}),
        )
        seconds = time.perf_counter() - started
        output.seek(0)
        text = output.read()
    # A step that outlasts its interrupt is killed with its process group, ``timeout`` itself
    # included (-9), which is a time-out, not a failure.
    killed = proc.returncode == -9 and seconds >= limit
    status = (
        "ok"
        if proc.returncode == 0
        else "timed out"
        if proc.returncode in (124, 137)
        else f"timed out, killed {KILL_AFTER} s after its interrupt"
        if killed
        else f"failed ({proc.returncode})"
    )
    step.result.update(status=status, seconds=round(seconds, 1), limit=limit)
    leftovers = kill_leftovers(mark)
    if leftovers:
        step.result["leftovers_killed"] = len(leftovers)
    log.write(
        f"\n===== {step.name}: {status}, {seconds:.0f} s (limit {limit} s)"
        f"{f'; {len(leftovers)} leftover process(es) killed' if leftovers else ''}\n$ "
        f"{' '.join(step.command)}\n"
        f"{text}"
    )
    log.flush()
    if proc.returncode:
        step.result["tail"] = text.strip().splitlines()[-15:]
    print(f"[gpu_check] {step.name}: {status} in {seconds:.0f} s", flush=True)


def read_outputs(step: Step, work: Path) -> None:
    path = work / f"{step.name}.json"
    if step.name == "kernel_tests":
        import xml.etree.ElementTree as ET

        # A pytest stopped by the step's limit writes no file: its tests are not counted.
        paths = sorted(work.glob("kernel_tests-*.xml"))
        if paths:
            counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
            failed = []
            for path in paths:
                suite = ET.parse(path).getroot()
                suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
                failed += [
                    f"{case.get('classname')}::{case.get('name')}"
                    for case in suite.iter("testcase")
                    if case.find("failure") is not None or case.find("error") is not None
                ]
                for k in counts:
                    counts[k] += int(suite.get(k, 0))
            step.result["tests"] = {**counts, "failed": failed, "files": len(paths)}
        return
    if path.exists():
        step.result["data"] = json.loads(path.read_text())


def trainer_runs(report: dict) -> list[dict]:
    """The report's trainer runs (one per trainer step that finished)."""
    return [
        s["data"]
        for s in report["steps"].values()
        if isinstance(s.get("data"), dict) and "overrides" in s["data"]
    ]


def lease_deadline(deadline: float, path: str | None) -> float:
    """The earlier of ``deadline`` (``time.perf_counter`` seconds) and the end written in ``path``
    (Unix seconds), where it holds one: a run started before its lease's end was known
    (``scripts/gpu_lease.sh``: the second device call writes it) plans its remaining steps against
    that end."""
    if not path:
        return deadline
    try:
        end = float(Path(path).read_text())
    except (OSError, ValueError):
        return deadline
    return min(deadline, time.perf_counter() + end - time.time())


_WRITING = threading.Lock()


def write_report(out: Path, report: dict) -> None:
    with _WRITING:
        _write_report(out, report)


def _write_report(out: Path, report: dict) -> None:
    write_atomic(out / "gpu_check.json", json.dumps(report, indent=2, default=str))
    write_atomic(out / "gpu_check.md", markdown(report))


def add_predictions(report: dict, deadline: float | None = None) -> None:
    """The planner's prediction beside each trainer run, while time is left (about 15 s each)."""
    if not planner_available():
        report["planner"] = "canon-titan plan is not available in this checkout: no predictions"
        return
    # Tiny mode checks the plumbing on one run, planned for an H100.
    gpu = (
        "h100"
        if report["tiny"]
        else report["steps"].get("env", {}).get("data", {}).get("gpu", "h100")
    )
    # Runs without a plan, or whose planning failed.
    runs = [r for r in trainer_runs(report) if "error" in r.get("planner", {"error": 1})][
        : 1 if report["tiny"] else None
    ]
    for run in runs:
        if deadline is not None and deadline - time.perf_counter() < 30:
            report["planner"] = (
                f"no time left to plan {sum('planner' not in r for r in runs)} run(s): "
                "`scripts/benchmarks/gpu_check.py --replan OUTDIR` adds them"
            )
            return
        run["planner"] = predict(run, gpu)
    report.pop("planner", None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out", nargs="?", help="output folder")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="toy sizes on the CPU (Triton's interpreter): checks the script",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=510,
        help="seconds for all steps (default 510: 9 minutes less setup)",
    )
    p.add_argument(
        "--only",
        help="comma list of steps to run, or their prefixes (linear_, float8_): a second "
        "command for what the first skipped",
    )
    p.add_argument(
        "--deadline-file",
        help="a file that may come to hold an earlier end (Unix seconds), read "
        "before each step (scripts/gpu_lease.sh's second call writes it)",
    )
    p.add_argument(
        "--replan",
        action="store_true",
        help="add the planner's predictions to OUTDIR's report (any machine) and rewrite "
        "gpu_check.md",
    )
    p.add_argument("--env", help=argparse.SUPPRESS)
    p.add_argument("--losses", help=argparse.SUPPRESS)
    p.add_argument("--warm", help=argparse.SUPPRESS)
    p.add_argument("--kernel-tests", help=argparse.SUPPRESS)
    p.add_argument("--case", nargs=2, metavar=("NAME", "JSON"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.kernel_tests:
        return kernel_tests(args.tiny, Path(args.kernel_tests))
    if args.env or args.losses or args.case or args.warm:  # a sub-step, in its own process
        if args.case:
            try:
                data, path = trainer_case(args.case[0], args.tiny), args.case[1]
            except RuntimeError as e:
                print(e, file=sys.stderr)
                return 1
        elif args.losses:
            loss_comparison(args.tiny, args.losses)
            return 0
        elif args.warm:
            warm_tuning(args.warm)
            return 0
        else:
            data, path = environment(), args.env
        if path == "-":
            print(json.dumps(data))
        else:
            write_atomic(path, json.dumps(data, indent=2))
        return 0
    if not args.out:
        p.error("the output folder is required")
    out = Path(args.out)
    if args.replan:
        report_path = out / "gpu_check.json"
        if not report_path.exists():
            p.error(f"--replan: {report_path} does not exist (run gpu_check.sh OUTDIR first)")
        report = json.loads(report_path.read_text())
        add_predictions(report)
        write_report(out, report)
        print(
            f"[gpu_check] planned {len(trainer_runs(report))} trainer run(s) into "
            f"{out / 'gpu_check.md'}"
        )
        return 0
    deadline = time.perf_counter() + args.budget
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, open(out / "gpu_check.log", "w") as log:
        work = Path(tmp)
        todo = steps(args.tiny, work)
        if args.only:
            wanted = args.only.split(",")
            unknown = [
                w
                for w in wanted
                if not any(s.name == w or (w.endswith("_") and s.name.startswith(w)) for s in todo)
            ]
            if unknown:
                p.error(
                    f"--only: unknown step(s) {', '.join(unknown)}; steps: "
                    f"{', '.join(s.name for s in todo)} "
                    "(a prefix ending in _ takes every step it starts)"
                )
            todo = [
                s
                for s in todo
                if any(s.name == w or (w.endswith("_") and s.name.startswith(w)) for w in wanted)
            ]
        report = {
            "tiny": args.tiny,
            "budget_s": args.budget,
            "steps": {s.name: {"status": "not run yet"} for s in todo},
        }
        if not args.tiny and TUNED.exists():
            report["tuning_restored"] = restore_tuning(
                json.loads(TUNED.read_text()), triton_cache_dir()
            )
        # Tiny: every step side by side, two at a time (nothing is timed).
        groups: list[list[Step]] = [todo] if args.tiny else []
        for step in [] if args.tiny else todo:
            if groups and step.group and groups[-1][0].group == step.group:
                groups[-1].append(step)
            else:
                groups.append([step])

        def run_in_time(step: Step) -> None:
            # A step past its limit gets 15 s to go.
            left = lease_deadline(deadline, args.deadline_file) - time.perf_counter() - 20
            fallback = None if args.tiny else torch_fallback(step.name, report)
            if fallback:
                step.result.update(status=f"skipped: {fallback}", seconds=0, limit=0)
            elif left < 30:
                step.result.update(status="skipped: no time left", seconds=0, limit=0)
            else:
                run_step(step, int(min(step.limit, left)), log)
                read_outputs(step, work)
            with (
                _WRITING
            ):  # the other step of a group may be writing: a copy, then the report, under the lock
                report["steps"][step.name] = dict(step.result)
                _write_report(out, report)
                if not args.tiny:
                    tuned = collect_tuning(triton_cache_dir())
                    if tuned:
                        write_atomic(out / "triton_autotune.json", json.dumps(tuned, indent=1))

        for group in groups:
            with ThreadPoolExecutor(2 if args.tiny else len(group)) as pool:
                list(pool.map(run_in_time, group))
        add_predictions(report, lease_deadline(deadline, args.deadline_file) + 20)
    write_report(out, report)
    print(
        f"[gpu_check] wrote {out / 'gpu_check.md'}, {out / 'gpu_check.json'}, "
        f"{out / 'gpu_check.log'}"
    )
    return 0 if all(s.result.get("status") == "ok" for s in todo) else 1


if __name__ == "__main__":
    sys.exit(main())
