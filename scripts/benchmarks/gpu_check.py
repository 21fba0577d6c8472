#!/usr/bin/env python
"""Everything a lent GPU should measure, in one run: the steps below in order, each a subprocess
under its own time limit (``timeout -s INT``, so a hang prints where it was and costs only its step),
all within ``--budget`` seconds; a step that no longer fits is skipped and named in the report. Run it
through ``scripts/gpu_check.sh OUTDIR``, which installs the offline kit first where needed.

  env             GPU, driver, torch/triton/fla/mamba-ssm versions, the kernel backends ``auto`` picks
  kernel_tests    the kernel tests on CUDA (pytest)                                  } run side by side
  losses          bf16 loss curves: llama_canon triton vs torch, gla5 fla vs torch,  }
                  mamba2 mamba_ssm vs torch (debug models, the trainer)
  canon_trainer   bench_canon.py --mode trainer: llama, llama_canon (triton, torch), 1B, seq 4096, compile
  ops             bench_canon.py --mode ops: Canon ops vs fla's causal_conv1d and the memory bound,
                  first-call compile+tune time, the autotuner's choices
  linear_trainer  bench_linear.py --tables trainer: llama, gla5, gdn2, mamba2 at seq 4096 and 16384
  float8          bench_canon.py --mode trainer with float8 tensorwise, then rowwise (llama_canon)
Beside each trainer configuration, the planner's prediction (``canon-titan plan`` for that GPU): a
calibration row each.

Writes OUTDIR/gpu_check.md (tables), gpu_check.json (everything) and gpu_check.log (every step's
output). ``--tiny`` runs each step at toy size on the CPU, in Triton's interpreter: a check that the
script works, not a measurement (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gpu_check_report import markdown

from canon_titan.tools.fileio import write_atomic

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


def steps(tiny: bool, work: Path) -> list[Step]:
    py = sys.executable
    if tiny:
        canon = ["--flavor", "debug", "--seq-len", "32", "--batch", "1", "--steps", "2", "--warmup", "1",
                 "--no-compile"]
        linear = ["--trainer-flavor", "debug", "--trainer-seqs", "32", "--trainer-tokens", "32", "--trainer-steps", "2",
                  "--trainer-warmup", "1", "--trainer-no-compile", "--trainer-models", "gla5:AbbCD"]
        ops = ["--flavor", "debug", "--seq-len", "32", "--batch", "1", "--reps", "1"]
        tests = ["tests/test_canon_triton.py", "-k", "fallback"]
        float8 = [("float8_tensorwise", "tensorwise")]
        backends, models = "triton", "llama_canon"
    else:
        canon = ["--steps", "15", "--warmup", "5"]
        linear = ["--trainer-models", "llama,gla5:AbbCD,gdn2:AbbCD,mamba2:AbbCD", "--trainer-steps", "15",
                  "--trainer-warmup", "5"]
        ops = []
        tests = ["tests/test_canon_triton.py", "tests/test_kernel_backends.py", "tests/test_canon_determinism.py"]
        float8 = [("float8_tensorwise", "tensorwise"), ("float8_rowwise", "rowwise")]
        backends, models = "triton,torch", "llama,llama_canon"
    bench_canon = [py, "scripts/benchmarks/bench_canon.py", "--mode"]
    out = [
        Step("env", 60, [py, SCRIPT, "--env", str(work / "env.json")]),
        Step("kernel_tests", 240, [py, "-m", "pytest", *tests, "-q", "-rfE", "-p", "no:cacheprovider",
                                   f"--junitxml={work / 'kernel_tests.xml'}"], group="correctness"),
        Step("losses", 240, [py, SCRIPT, "--losses", str(work / "losses.json")] + (["--tiny"] if tiny else []),
             group="correctness"),
        Step("canon_trainer", 240, [*bench_canon, "trainer", *canon, "--models", models, "--canon-backend", backends,
                                    "--json", str(work / "canon_trainer.json")]),
        Step("ops", 120, [*bench_canon, "ops", *ops, "--json", str(work / "ops.json")]),
        Step("linear_trainer", 300, [py, "scripts/benchmarks/bench_linear.py", "--tables", "trainer", *linear,
                                     "--json", str(work / "linear_trainer.json")]),
    ]
    emulate = " --float8.emulate=true" if tiny else ""
    for name, recipe in float8:
        out.append(Step(name, 120, [*bench_canon, "trainer", *canon, "--models", "llama_canon", "--canon-backend",
                                    "triton", "--trainer-args",
                                    f"--float8.enable=true --float8.recipe_name={recipe}{emulate}",
                                    "--json", str(work / f"{name}.json")]))
    return out


# ----------------------------------------------------------------------------- sub-steps run by this script


def environment() -> dict:
    import torch
    import triton

    from canon_titan.kernels import backends

    gpu = {}
    if torch.cuda.is_available():
        gpu = {"gpu": torch.cuda.get_device_name(), "capability": "sm_%d%d" % torch.cuda.get_device_capability(),
               "memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30}
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        gpu["driver"] = smi.stdout.strip() or smi.stderr.strip()
    packages = {"torch": torch.__version__, "triton": triton.__version__}
    for backend in ("fla", "mamba_ssm"):
        problem = backends.import_problem(backend)
        packages[backend] = problem or backends.installed_version(backend)
    chosen = {op: backends.resolve_backend("auto", op=op) for op in backends.CUDA_BACKENDS}
    return {**gpu, "python": sys.version.split()[0], "packages": packages,
            "auto_backends": {op: f"{b}" + (f" ({why})" if why else "") for op, (b, why) in chosen.items()}}


LOSS_PAIRS = [("llama_canon", "canon_backend", "triton"), ("gla5", "kernel_backend", "fla"),
              ("mamba2", "kernel_backend", "mamba_ssm")]


def loss_comparison(tiny: bool) -> dict:
    """Each pair trains the same debug model from the same seed with the Triton backend and with torch;
    the loss curves' largest difference."""
    from trainer_bench import run_case

    # Tiny: GLA5 on fla only (the trainer steps run llama_canon's Triton kernels; mamba_ssm's trainer
    # path is fla's), one step.
    pairs = LOSS_PAIRS[1:2] if tiny else LOSS_PAIRS
    steps, seq, layers = (1, 32, 1) if tiny else (200, 256, 4)
    cases = [(name, key, backend) for name, key, cuda in pairs for backend in (cuda, "torch")]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(cases)) as pool:
        runs = pool.map(lambda c: run_case({"name": c[0], "flavor": "debug", "n_layers": layers, c[1]: c[2]},
                                           os.path.join(tmp, f"{c[0]}-{c[2]}"), seq_len=seq, batch=4, steps=steps,
                                           warmup=0, compile=False), cases)
        runs = {(c[0], c[2]): r for c, r in zip(cases, runs)}
    out = {}
    for name, _, cuda in pairs:
        got, want = runs[(name, cuda)]["losses"], runs[(name, "torch")]["losses"]
        assert list(got) == list(want) and got, f"{name}: steps {list(got)} vs {list(want)}"
        diffs = [abs(got[s] - want[s]) for s in want]
        out[f"{name} {cuda} vs torch"] = {"steps": len(want), "first_loss": want[min(want)],
                                          "last_loss": want[max(want)], "max_abs_diff": max(diffs),
                                          "max_rel_diff": max(d / abs(want[s]) for d, s in zip(diffs, want)),
                                          "kernels": runs[(name, cuda)]["kernels"]}
    return out


# ----------------------------------------------------------------------------- the planner


def planner_available() -> bool:
    proc = subprocess.run([sys.executable, "-m", "canon_titan.cli", "plan", "--help"], cwd=REPO, capture_output=True)
    return proc.returncode == 0


def predict(run: dict, gpu: str) -> dict:
    """The planner's prediction for a benchmark run (its config and overrides)."""
    proc = subprocess.run([sys.executable, "-m", "canon_titan.cli", "plan", run["config"], "--gpus",
                           str(run.get("nproc", 1)), "--gpu", gpu, "--json", *run["overrides"]], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(proc.stdout)


# ----------------------------------------------------------------------------- running and reporting


def run_step(step: Step, limit: int, log) -> None:
    started = time.perf_counter()
    proc = subprocess.run(["timeout", "-s", "INT", str(limit), *step.command], cwd=REPO, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    seconds = time.perf_counter() - started
    status = "ok" if proc.returncode == 0 else ("timed out" if proc.returncode == 124 else f"failed ({proc.returncode})")
    step.result.update(status=status, seconds=round(seconds, 1), limit=limit)
    log.write(f"\n===== {step.name}: {status}, {seconds:.0f} s (limit {limit} s)\n$ {' '.join(step.command)}\n"
              f"{proc.stdout}{proc.stderr}")
    log.flush()
    if proc.returncode:
        step.result["tail"] = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    print(f"[gpu_check] {step.name}: {status} in {seconds:.0f} s", flush=True)


def read_outputs(step: Step, work: Path) -> None:
    path = work / f"{step.name}.json"
    if step.name == "kernel_tests":
        path = work / "kernel_tests.xml"
        if path.exists():
            import xml.etree.ElementTree as ET

            suite = ET.parse(path).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                      if case.find("failure") is not None or case.find("error") is not None]
            step.result["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            step.result["tests"]["failed"] = failed
        return
    if path.exists():
        step.result["data"] = json.loads(path.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", help="output folder")
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (Triton's interpreter): checks the script")
    p.add_argument("--budget", type=float, default=510, help="seconds for all steps (default 510: 9 minutes less setup)")
    p.add_argument("--only", help="comma list of steps to run (e.g. a second command for what the first skipped)")
    p.add_argument("--env", help=argparse.SUPPRESS)
    p.add_argument("--losses", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.env or args.losses:  # a sub-step, in its own process
        data = environment() if args.env else loss_comparison(args.tiny)
        write_atomic(args.env or args.losses, json.dumps(data, indent=2))
        return 0
    if not args.out:
        p.error("the output folder is required")
    deadline = time.perf_counter() + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, open(out / "gpu_check.log", "w") as log:
        work = Path(tmp)
        todo = steps(args.tiny, work)
        if args.only:
            wanted = set(args.only.split(","))
            unknown = wanted - {s.name for s in todo}
            if unknown:
                p.error(f"--only: unknown step(s) {', '.join(sorted(unknown))}; steps: {', '.join(s.name for s in todo)}")
            todo = [s for s in todo if s.name in wanted]
        # Tiny: every step side by side, two at a time (nothing is timed).
        groups: list[list[Step]] = [todo] if args.tiny else []
        for step in [] if args.tiny else todo:
            if groups and step.group and groups[-1][0].group == step.group:
                groups[-1].append(step)
            else:
                groups.append([step])

        def run_in_time(step: Step) -> None:
            left = deadline - time.perf_counter() - 5
            if left < 30:
                step.result.update(status="skipped: no time left", seconds=0, limit=0)
                return
            run_step(step, int(min(step.limit, left)), log)
            read_outputs(step, work)

        for group in groups:
            with ThreadPoolExecutor(2 if args.tiny else len(group)) as pool:
                list(pool.map(run_in_time, group))
        report = {"tiny": args.tiny, "budget_s": args.budget, "steps": {s.name: s.result for s in todo}}
        env = report["steps"].get("env", {}).get("data", {})
        if planner_available():
            # Tiny mode checks the plumbing on one run per step, planned for an H100.
            gpu = "h100" if args.tiny else env.get("gpu", "h100")
            for step in todo:
                for run in _trainer_runs(step)[:1 if args.tiny else None]:
                    run["planner"] = predict(run, gpu)
        else:
            report["planner"] = "canon-titan plan is not available in this checkout: no predictions"
    write_atomic(out / "gpu_check.json", json.dumps(report, indent=2, default=str))
    write_atomic(out / "gpu_check.md", markdown(report))
    print(f"[gpu_check] wrote {out / 'gpu_check.md'}, {out / 'gpu_check.json'}, {out / 'gpu_check.log'}")
    return 0 if all(s.result.get("status") == "ok" for s in todo) else 1


def _trainer_runs(step: Step) -> list[dict]:
    data = step.result.get("data")
    if isinstance(data, dict):  # bench_linear: {"trainer": [...]}
        data = data.get("trainer")
    return [r for r in data or [] if isinstance(r, dict) and "overrides" in r]


if __name__ == "__main__":
    sys.exit(main())
