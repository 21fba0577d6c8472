"""scripts/gpu_check.sh, the one command for a lent GPU, in its tiny mode (every step at toy size on
this CPU, Triton's interpreter for the kernels), so that it keeps working between GPU sessions; and
its time limits."""

import json
import subprocess
import sys
import time

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.slow
def test_tiny_mode_runs_every_step_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out), "--tiny"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((out / "gpu_check.json").read_text())
    steps = report["steps"]
    assert set(steps) == {"env", "kernel_tests", "losses", "canon_trainer", "ops", "linear_trainer",
                          "float8_tensorwise"}
    assert all(s["status"] == "ok" for s in steps.values()), steps
    assert steps["kernel_tests"]["tests"]["tests"] >= 1 and not steps["kernel_tests"]["tests"]["failed"]
    # GLA5 trained on fla's kernels by the trainer (in the interpreter), against torch.
    (pair,) = steps["losses"]["data"].values()
    assert "gla kernel backend fla (requested fla)" in pair["kernels"] and pair["max_rel_diff"] < 1e-4
    assert "conv backend triton (requested triton)" in steps["canon_trainer"]["data"][0]["kernels"]
    assert [c["call"] for c in steps["ops"]["data"]["calls"]] == ["A", "D", "b (Mamba2)"]
    md = (out / "gpu_check.md").read_text()
    for heading in ("Loss curves", "Trainer: llama vs llama_canon", "Canon ops", "Trainer: linear models",
                    "Trainer: float8", " planner |"):
        assert heading in md
    planned = [r["planner"] for r in steps["canon_trainer"]["data"] if "planner" in r]
    assert planned and "tokens_per_second_per_gpu" in planned[0], planned
    assert "===== float8_tensorwise: ok" in (out / "gpu_check.log").read_text()


def test_a_step_past_its_limit_is_interrupted_and_reported(tmp_path):
    step = gpu_check.Step("hang", 1, [sys.executable, "-c", "import time; time.sleep(60)"])
    started = time.perf_counter()
    with open(tmp_path / "log", "w") as log:
        gpu_check.run_step(step, 1, log)
    assert time.perf_counter() - started < 10
    assert step.result["status"] == "timed out" and "KeyboardInterrupt" in "\n".join(step.result["tail"])
