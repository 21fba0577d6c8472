"""scripts/gpu_check.sh, the one command for a lent GPU, in its tiny mode (every step at toy size on
this CPU, Triton's interpreter for the kernels), so that it keeps working between GPU sessions; and
its time limits."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.slow
def test_tiny_mode_runs_every_step_and_writes_the_report(tmp_path, monkeypatch):
    """Through ``scripts/gpu_lease.sh``, as a lease runs it: a first call starts the check in a
    session of its own and brings back what it has written by its end; a second follows it until it
    ends."""
    lease, run, first, out = (
        REPO / "scripts" / "gpu_lease.sh",
        tmp_path / "run",
        tmp_path / "first",
        tmp_path / "out",
    )
    proc = subprocess.run(
        ["bash", str(lease), "start", str(run), str(first), "3", "--tiny"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3 and "follow it in the next call" in proc.stdout, (
        proc.stdout + proc.stderr
    )
    assert (first / "console.log").exists()
    again = subprocess.run(
        ["bash", str(lease), "start", str(run), str(first), "3", "--tiny"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 2 and "already holds a run" in again.stderr
    following = time.time()
    proc = subprocess.run(
        ["bash", str(lease), "follow", str(run), str(out), "900"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=960,
    )
    assert proc.returncode == 0 and "the check has ended" in proc.stdout, (
        proc.stdout + proc.stderr
    )[-4000:]
    assert "[gpu_check] wrote" in (out / "console.log").read_text()
    # The follower's end less 25 s, for the check to plan its last steps by.
    assert float((run / "deadline").read_text()) == pytest.approx(following + 900 - 25, abs=5)
    report = json.loads((out / "gpu_check.json").read_text())
    steps = report["steps"]
    assert set(steps) == {
        "env",
        "kernel_tests",
        "losses",
        "canon_triton",
        "canon_bwd_blocks",
        "ops",
        "linear_gla5_4k",
        "float8_tensorwise",
        "float8_gemms",
    }
    assert all(s["status"] == "ok" for s in steps.values()), steps
    # The host that ran it: its CPU and cores (a host-bound step runs at its speed).
    assert steps["env"]["data"]["host"].endswith(f", {os.cpu_count()} cores")
    assert (
        steps["kernel_tests"]["tests"]["tests"] >= 1
        and not steps["kernel_tests"]["tests"]["failed"]
    )
    # GLA5 trained on fla's kernels by the trainer (in the interpreter), against torch.
    (pair,) = steps["losses"]["data"].values()
    assert (
        "gla kernel backend fla (requested fla)" in pair["kernels"] and pair["max_rel_diff"] < 1e-4
    )
    canon = steps["canon_triton"]["data"]
    assert "conv backend triton (requested triton)" in canon["kernels"]
    # The profiled step (one past the timed ones) names the Canon op among its costs.
    assert canon["profile_summary"]["total_ms"] > 0
    assert any("canon" in name for name, _ in canon["profile_summary"]["top_ms"])
    assert sorted(int(s) for s in canon["losses"]) == [
        1,
        2,
    ]  # the profiled steps are not the run's figures
    assert [c["call"] for c in steps["ops"]["data"]["calls"]] == ["A", "D", "b (Mamba2)"]
    sweep = steps["canon_bwd_blocks"]["data"]["rows"]
    assert {r["call"] for r in sweep} == {"A", "D", "b (Mamba2)"} and sum(
        r["current"] for r in sweep
    ) == 3
    md = (out / "gpu_check.md").read_text()
    for heading in (
        "Loss curves",
        "Trainer: llama vs llama_canon",
        "Canon ops",
        "Trainer: linear models",
        "Trainer: float8",
        " planner |",
        "profile of llama_canon (triton)",
        "Canon backward kernels by block configuration",
        "planned / measured ms by kind: ",
        "Float8 GEMMs of one block",
    ):
        assert heading in md
    # The float8 table compares with the bf16 run of the same model (its base).
    float8_table = md.split("Trainer: float8")[1].split("\n\n**")[0]
    assert (
        "| llama_canon (triton) | 32 |" in float8_table
        and "| llama_canon (triton) tensorwise | 32 |" in float8_table
    )
    assert "planner" in canon and "tokens_per_second_per_gpu" in canon["planner"], canon.get(
        "planner"
    )
    assert "===== float8_tensorwise: ok" in (out / "gpu_check.log").read_text()

    # --replan plans what a cut-short GPU run left unplanned, from the report alone (the planner
    # itself ran above; here a stand-in records what it is asked).
    del canon["planner"]
    (out / "gpu_check.json").write_text(json.dumps(report))
    asked = []
    monkeypatch.setattr(
        gpu_check, "predict", lambda run, gpu: asked.append((run["case"], gpu)) or {"mfu": 0.5}
    )
    assert gpu_check.main([str(out), "--replan"]) == 0
    assert asked == [("canon_triton", "h100")]
    replanned = json.loads((out / "gpu_check.json").read_text())["steps"]["canon_triton"]["data"]
    assert (
        replanned["planner"] == {"mfu": 0.5} and "50.0% MFU" in (out / "gpu_check.md").read_text()
    )


def test_steps_run_in_the_order_of_their_value():
    """A run cut short keeps what matters most: the kernel checks, the Canon ratio, the loss
    agreement, the linear models at the recipes' 16k (their figure of record) then 4k, float8, then
    the op microbenchmarks."""
    names = [s.name for s in gpu_check.steps(False, REPO)]
    first = {
        prefix: min(i for i, n in enumerate(names) if n.startswith(prefix))
        for prefix in (
            "env",
            "kernel_tests",
            "canon_llama",
            "canon_triton",
            "linear_",
            "float8_",
            "canon_bwd_blocks",
            "ops",
        )
    }
    assert list(first) == sorted(first, key=first.get)
    assert (
        gpu_check.steps(False, REPO)[names.index("losses")].group == "correctness"
    )  # beside the kernel tests
    linear = [n for n in names if n.startswith("linear_")]
    # 16k (Llama's first, Mamba2 with CUDA graphs after the three families) before 4k; GLA5 and GDN2
    # with the others, before float8 and the Canon op microbenchmarks.
    assert linear == sorted(linear, key=lambda n: "_4k" in n)
    assert linear[0] == "linear_llama_16k" and linear.index("linear_mamba2_16k_graphs") == 4
    assert (
        names.index("linear_gdn2_4k")
        < names.index("float8_tensorwise")
        < names.index("canon_bwd_blocks")
        < names.index("canon_fwd_blocks")
        < names.index("ops")
    )
    # The CP rank's attention after the op microbenchmarks (issue 42's question, not the Canon
    # op's); not in --tiny, whose test would only repeat what its own test checks.
    assert names.index("cp_attention") == names.index("ops") + 1
    assert "cp_attention" not in [s.name for s in gpu_check.steps(True, REPO)]
    # Every trainer run names a base that runs before it.
    for case in gpu_check.cases():
        if case.base:
            assert names.index(case.base) < names.index(case.name), case


def test_the_warm_tuning_step_trains_each_case_untimed_and_lists_those_that_finished(
    tmp_path, monkeypatch
):
    """It runs beside the correctness checks (not in tiny mode: the interpreter tunes nothing), two
    compiled steps of each case at its model and batch; without a GPU of 120 GB or more, a quarter
    of its length."""
    import trainer_bench

    calls = []

    def run_case(model, dump, **kw):
        calls.append((model, kw))
        if model["name"] == "gla5":
            raise RuntimeError(
                "gla5 at seq 4096 failed (exit 1):\n...\ntorch.OutOfMemoryError: CUDA out of memory"
            )
        return {}

    monkeypatch.setattr(trainer_bench, "run_case", run_case)
    gpu_check.warm_tuning(str(tmp_path / "warm.json"))
    # A failed case is named with its last line; the other is still listed.
    assert json.loads((tmp_path / "warm.json").read_text()) == {
        "warmed": ["linear_mamba2_16k"],
        "failed": {"linear_gla5_16k": "torch.OutOfMemoryError: CUDA out of memory"},
    }
    for (model, kw), name in zip(sorted(calls, key=lambda c: c[0]["name"]), sorted(gpu_check.WARM)):
        case = next(c for c in gpu_check.cases() if c.name == name)
        assert model == case.model and kw["batch"] == case.batch == 1
        assert (
            kw["steps"] == 2 and kw["compile"] and kw["seq_len"] == 4096
        )  # no GPU here: the small-GPU length
    by_name = {s.name: s for s in gpu_check.steps(False, REPO)}
    assert by_name["warm_tuning"].group == "correctness"
    assert "warm_tuning" not in {s.name for s in gpu_check.steps(True, REPO)}


def test_a_linear_case_on_the_torch_fallback_is_skipped_and_says_why():
    """Where ``auto`` runs a case's recurrence on torch (GDN2 on Hopper with Triton < 3.7.1), the
    case is skipped with the reason from the env step; a case on its kernel, or without a
    recurrence, runs."""
    report = {
        "steps": {
            "env": {
                "data": {
                    "auto_backends": {
                        "canon": "triton",
                        "gla": "fla",
                        "ssd": "mamba_ssm",
                        "gated_delta_rule": "torch (fla refuses it (issue 640))",
                    }
                }
            }
        }
    }
    assert (
        gpu_check.torch_fallback("linear_gdn2_4k", report)
        == "auto runs gated_delta_rule on torch here: fla refuses it (issue 640)"
    )
    assert gpu_check.torch_fallback("linear_gdn2_16k", report).startswith(
        "auto runs gated_delta_rule on torch"
    )
    for name in (
        "linear_gla5_4k",
        "linear_mamba2_16k",
        "linear_llama_16k",
        "canon_triton",
        "kernel_tests",
    ):
        assert gpu_check.torch_fallback(name, report) is None, name


def test_profile_summary_sums_kernels_by_name_and_kind(tmp_path):
    """A hand-made trace: the GPU kernels summed by name and sorted into kinds; CPU ops are ignored
    when kernels are present."""
    import gzip

    import trainer_bench

    events = [
        {"cat": "kernel", "name": "nvjet_sm90_tst_128x256", "dur": 3000},
        {"cat": "kernel", "name": "nvjet_sm90_tst_128x256", "dur": 1000},
        {"cat": "kernel", "name": "_canon_bwd_kernel", "dur": 2500},
        {"cat": "kernel", "name": "cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "dur": 1500},
        {"cat": "kernel", "name": "triton_poi_fused_mul_silu_0", "dur": 500},
        {"cat": "kernel", "name": "void at::native::chunk_cat_cuda_kernel", "dur": 250},
        {"cat": "kernel", "name": "chunk_gla_fwd_kernel_o", "dur": 125},
        {"cat": "kernel", "name": "cutlass_anything_else", "dur": 0},
        {"cat": "kernel", "name": "memcpy32_post", "dur": 125},
        {"cat": "cpu_op", "name": "aten::mm", "dur": 99999},
        {"cat": "user_annotation", "name": "ProfilerStep#14", "dur": 12000},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 7, "ts": 1000, "tid": 1},
        {"cat": "cuda_driver", "name": "cuLaunchKernel", "dur": 13, "ts": 1045, "tid": 1},
        {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "dur": 500, "ts": 1010, "tid": 1},
        {"cat": "cuda_runtime", "name": "cuLaunchKernel", "dur": 20, "ts": 1020, "tid": 2},
        {"cat": "cpu_op", "name": "canon_titan::canon_conv", "dur": 40, "ts": 1000, "tid": 1},
        {"cat": "cpu_op", "name": "canon_titan::canon_conv", "dur": 60, "ts": 1040, "tid": 2},
        {"cat": "cpu_op", "name": "canon_titan::canon_swiglu", "dur": 250},
    ]
    trace = tmp_path / "rank0_trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = trainer_bench.profile_summary(trace, top=2)
    assert summary["total_ms"] == 9.0
    assert summary["kinds_ms"] == {
        "gemm": 4.0,
        "canon (triton)": 2.5,
        "attention": 1.5,
        "inductor (fused)": 0.5,
        "torch (copies, optimizer)": 0.25,
        "fla / mamba (triton)": 0.125,
        "other": 0.125,
    }
    assert summary["top_ms"] == [["nvjet_sm90_tst_128x256", 4.0], ["_canon_bwd_kernel", 2.5]]
    # The host's side: the step's span, three launches (a memcpy is not one), the custom ops by
    # time, each with the launches on its thread within its span (the 45 us launch is on thread 1
    # after its call there ended; the one on thread 2 precedes that thread's call).
    assert summary["host"] == {
        "step_ms": 12.0,
        "launches": 3,
        "launch_ms": 0.04,
        "custom_ops": {
            "canon_titan::canon_swiglu": {"calls": 1, "ms": 0.25, "launches": 0, "launch_ms": 0.0},
            "canon_titan::canon_conv": {"calls": 2, "ms": 0.1, "launches": 1, "launch_ms": 0.007},
        },
    }
    import gpu_check_report

    (line,) = gpu_check_report._host(summary["host"])
    assert line == (
        "  host: the step spans 12.0 ms on the host, 3 kernel launches (0.0 ms in the "
        "launch calls); custom "
        "ops (launches included): `canon_swiglu` 1 calls 0.2 ms; `canon_conv` 2 calls 0.1 ms "
        "(1 launches, 0.0 ms)"
    )


def test_a_lease_end_written_later_shortens_the_budget(tmp_path):
    """The end that ``gpu_lease.sh follow`` writes (Unix seconds) is taken where it is earlier than
    the run's own; absent or unreadable, the run's own stands."""
    path, own = tmp_path / "deadline", time.perf_counter() + 1000
    assert gpu_check.lease_deadline(own, None) == own == gpu_check.lease_deadline(own, str(path))
    path.write_text("soon")
    assert gpu_check.lease_deadline(own, str(path)) == own
    path.write_text(str(time.time() + 100))
    assert gpu_check.lease_deadline(own, str(path)) - time.perf_counter() == pytest.approx(
        100, abs=1
    )
    path.write_text(str(time.time() + 5000))
    assert gpu_check.lease_deadline(own, str(path)) == own


def test_a_step_past_its_limit_is_interrupted_and_reported(tmp_path):
    step = gpu_check.Step("hang", 1, [sys.executable, "-c", "import time; time.sleep(60)"])
    started = time.perf_counter()
    with open(tmp_path / "log", "w") as log:
        gpu_check.run_step(step, 1, log)
    assert time.perf_counter() - started < 10
    assert step.result["status"] == "timed out" and "KeyboardInterrupt" in "\n".join(
        step.result["tail"]
    )
    # The host's 1-minute load as it started (what else ran beside it).
    assert step.result["load_before"] == pytest.approx(os.getloadavg()[0], abs=2)


def test_a_step_that_outlasts_its_interrupt_is_killed_and_reported_as_timed_out(
    tmp_path, monkeypatch
):
    """The KILL that follows the interrupt takes ``timeout`` with it (its process group): the step
    timed out, it did not fail."""
    monkeypatch.setattr(gpu_check, "KILL_AFTER", 1)
    deaf = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    step = gpu_check.Step("deaf", 1, [sys.executable, "-c", deaf])
    started = time.perf_counter()
    with open(tmp_path / "log", "w") as log:
        gpu_check.run_step(step, 1, log)
    assert time.perf_counter() - started < 10
    assert step.result["status"] == "timed out, killed 1 s after its interrupt", step.result
    # A step killed from elsewhere before its limit failed.
    step = gpu_check.Step(
        "killed", 30, [sys.executable, "-c", "import os, signal; os.killpg(0, signal.SIGKILL)"]
    )
    with open(tmp_path / "log", "w") as log:
        gpu_check.run_step(step, 30, log)
    assert step.result["status"] == "failed (-9)", step.result


def test_a_steps_processes_in_sessions_of_their_own_do_not_outlive_it(tmp_path):
    """torchrun starts its workers in new sessions, out of reach of the step's ``timeout``: the
    step's leftovers are found by the mark in their environment and killed before the next step runs
    (and a process without the mark is left alone)."""
    spawn = (
        "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(120)'], "
        "start_new_session=True, env={**__import__('os').environ, **dict(%s)})"
    )
    stranger = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
    )
    try:
        step = gpu_check.Step("spawns", 30, [sys.executable, "-c", spawn % "()"])
        with open(tmp_path / "log", "w") as log:
            gpu_check.run_step(step, 30, log)
        assert step.result["status"] == "ok" and step.result["leftovers_killed"] == 1
        assert "1 leftover process(es) killed" in (tmp_path / "log").read_text()
        assert not gpu_check.leftover_processes(f"spawns-{os.getpid()}")
        assert stranger.poll() is None
        # Without the kill, the child would still be there: a step whose child carries another mark
        # has no leftovers to report, and its child outlives it.
        other = f"elsewhere-{os.getpid()}"
        step = gpu_check.Step(
            "other", 30, [sys.executable, "-c", spawn % f"{gpu_check.STEP_MARK}='{other}'"]
        )
        with open(tmp_path / "log", "w") as log:
            gpu_check.run_step(step, 30, log)
        assert "leftovers_killed" not in step.result
        assert len(gpu_check.kill_leftovers(other)) == 1
    finally:
        stranger.kill()


def test_autotuning_results_go_from_one_run_to_the_next(tmp_path):
    """What Triton's autotuners wrote into its cache (``<key>/<kernel>.autotune.json``) is
    collected, and restored into an empty cache where absent (a present entry is kept); a name that
    would leave the cache is refused. (Triton reads these files only on a GPU: its interpreter never
    caches tuning.)"""
    cache = tmp_path / "cache"
    (cache / "k1").mkdir(parents=True)
    (cache / "k1" / "kernel_a.autotune.json").write_text('{"a": 1}')
    (cache / "k1" / "kernel_a.cubin").write_text("binary")
    (cache / "k2").mkdir()
    (cache / "k2" / "kernel_b.autotune.json").write_text('{"b": 2}')
    files = gpu_check.collect_tuning(cache)
    assert files == {
        "k1/kernel_a.autotune.json": '{"a": 1}',
        "k2/kernel_b.autotune.json": '{"b": 2}',
    }
    fresh = tmp_path / "fresh"
    (fresh / "k2").mkdir(parents=True)
    (fresh / "k2" / "kernel_b.autotune.json").write_text('{"b": 3}')
    assert gpu_check.restore_tuning(files, fresh) == 1
    assert gpu_check.collect_tuning(fresh) == {**files, "k2/kernel_b.autotune.json": '{"b": 3}'}
    for bad in ("../outside.autotune.json", "/abs/x.autotune.json", "k1/kernel_a.cubin"):
        with pytest.raises(ValueError, match="is not a file of Triton's cache"):
            gpu_check.restore_tuning({bad: "{}"}, fresh)


def test_planned_and_measured_time_by_kind_from_a_hand_made_run():
    """The profile's kinds are mapped to the planner's (GEMMs to matmul, the rest to other), and the
    step's time beyond its kernels is ``idle``: 8192 tokens at 40,960 tokens/s is 200 ms a step."""
    import gpu_check_report

    run = {
        "batch": 2,
        "seq_len": 4096,
        "tokens_per_s": 40960.0,
        "profile_summary": {
            "total_ms": 150.0,
            "kinds_ms": {
                "gemm": 80.0,
                "attention": 30.0,
                "canon (triton)": 10.0,
                "inductor (fused)": 20.0,
                "torch (copies, optimizer)": 10.0,
            },
        },
        "planner": {
            "step_seconds": 0.16,
            "ranks": [
                {
                    "time": {
                        "compute": {
                            "matmul": 0.09,
                            "attention": 0.03,
                            "canon": 0.005,
                            "other": 0.035,
                        }
                    }
                }
            ],
        },
    }
    kinds = gpu_check_report.by_planner_kind(run)
    want = {
        "matmul": (90.0, 80.0),
        "attention": (30.0, 30.0),
        "canon": (5.0, 10.0),
        "other": (35.0, 30.0),
        "idle": (0.0, 50.0),
    }
    assert set(kinds) == set(want)
    for kind, pair in want.items():
        assert kinds[kind] == pytest.approx(pair), kind
    assert gpu_check_report.by_planner_kind({**run, "planner": None}) is None


def test_a_linear_case_without_figures_says_why_in_its_table():
    """GDN2 skipped where ``auto`` runs its recurrence on torch (fla refuses its backward on Hopper
    with Triton < 3.7.1), GLA5 past its limit: each a row of the linear table, beside the runs that
    have figures."""
    import gpu_check_report

    llama = {
        "table": "linear",
        "case": "linear_llama_16k",
        "label": "llama",
        "base": None,
        "batch": 1,
        "seq_len": 16384,
        "tokens_per_s": 35294.0,
        "mfu_pct": 60.9,
        "peak_reserved_gib": 39.64,
        "peak_active_gib": 30.0,
        "first_step_s": 12.7,
        "kernels": "",
    }
    why = (
        "skipped: auto runs gated_delta_rule on torch here: flash-linear-attention 0.6.0 "
        "refuses ..."
    )
    report = {
        "tiny": False,
        "steps": {
            "linear_llama_16k": {"status": "ok", "data": llama},
            "linear_gla5_16k": {"status": "timed out"},
            "linear_gdn2_16k": {"status": why},
        },
    }
    table = gpu_check_report.markdown(report).split("Trainer: linear models")[1].split("\n\n")[1]
    rows = table.splitlines()
    assert rows[2].startswith("| llama | 16384 | 35,294 |")
    assert rows[3:] == [
        "| linear_gla5_16k | | timed out | | | | | | |",
        f"| linear_gdn2_16k | | {why} | | | | | | |",
    ]


def test_the_canon_ratio_of_record_runs_first_at_the_recipes_batch():
    """The first trainer runs are Llama-1B and LlamaCanon-1B (Triton) at the 1B recipes' local
    batch, 8 x 4096, the second against the first, each with a profiled step; bench_canon's trainer
    mode runs that shape too."""
    import tomllib

    import bench_canon

    recipe = tomllib.loads(
        (REPO / "train_configs" / "LlamaCanon-1B-Nemo-1T-lr0.003.toml").read_text()
    )["training"]
    llama, canon = [c for c in gpu_check.cases() if c.table == "canon"][:2]
    assert [c.name for c in gpu_check.cases()][:2] == [llama.name, canon.name]
    assert (llama.model["name"], canon.model["name"], canon.model["canon_backend"]) == (
        "llama",
        "llama_canon",
        "triton",
    )
    assert {(c.seq, c.batch) for c in (llama, canon)} == {
        (recipe["seq_len"], recipe["local_batch_size"])
    }
    assert canon.base == llama.name
    args = bench_canon.parse_args(["--mode", "trainer"])
    assert (args.seq_len, args.batch) == (recipe["seq_len"], recipe["local_batch_size"])


def test_the_canon_step_against_llamas_from_hand_made_profiles():
    """The Canon row's profile line: its Canon kernels, Inductor's fused kernels against Llama's
    (those the Canon ops take over), and each step's idle time (32,768 tokens at 65,536 tokens/s:
    500 ms a step; at 52,428.8: 625 ms)."""
    import gpu_check_report

    llama = {
        "label": "llama, batch 8",
        "batch": 8,
        "seq_len": 4096,
        "tokens_per_s": 65536.0,
        "profile_summary": {
            "total_ms": 450.0,
            "kinds_ms": {"gemm": 300.0, "inductor (fused)": 150.0},
        },
    }
    canon = {
        "label": "llama_canon (triton), batch 8",
        "batch": 8,
        "seq_len": 4096,
        "tokens_per_s": 52428.8,
        "profile_summary": {
            "total_ms": 540.0,
            "kinds_ms": {"gemm": 300.0, "canon (triton)": 110.0, "inductor (fused)": 130.0},
        },
    }
    (line, _) = gpu_check_report._canon_step(canon, llama)
    assert (
        "Canon kernels 110.0; Inductor's fused kernels 130.0 against 150.0 (taken over by "
        "Canon's ops: 20.0); "
        "idle 85.0 against 50.0; all kernels 540.0 against 450.0"
    ) in line
    assert (
        gpu_check_report._canon_step(llama, None) == []
        and gpu_check_report._canon_step(canon, canon) == []
    )


@pytest.mark.parametrize("forward", [True, False])
def test_the_float8_gemm_benchmark_computes_what_torchao_computes(forward):
    """bench_float8_gemm's float8 ways are the GEMM the planner's linears run: each equals the
    product of its dequantized float8 operands in fp32 (to bf16 rounding), the row-wise backward way
    (tensor-wise kernel, then the outer product of the inverse scales) as well as the row-wise
    kernel; and its block holds the seven linears of a Llama block at their TP shard, by hand for
    Llama 3.1 8B at TP 8."""
    import torch

    from bench_float8_gemm import LLAMA31, block_linears, gemm_ways

    ways, reference = gemm_ways(48, 64, 32, forward, torch.device("cpu"))
    for way in ("tensorwise", "rowwise"):
        got, want = ways[way]().float(), reference(way)
        assert got.shape == want.shape == (48, 32)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    assert ways["bf16"]().shape == (48, 32)
    assert block_linears("Llama-8B-Nemo-1T-lr0.003", LLAMA31["8B"], 8) == [
        ("wq", 4096, 512),
        ("wk", 4096, 128),
        ("wv", 4096, 128),
        ("wo", 512, 4096),
        ("w1", 4096, 1792),
        ("w3", 4096, 1792),
        ("w2", 1792, 4096),
    ]


def test_the_forward_block_sweep_times_every_candidate_and_marks_the_fixed_one(tmp_path):
    """``bench_canon.py --mode fwd_blocks`` (the lease's ``canon_fwd_blocks``), at toy size in the
    interpreter: each swept call at each configuration of ``FORWARD_CONFIGS``, the fixed
    ``FORWARD_BLOCKS`` marked once per call."""
    from canon_titan.kernels import canon

    out = tmp_path / "fwd.json"
    proc = subprocess.run(
        [sys.executable, "scripts/benchmarks/bench_canon.py", "--mode", "fwd_blocks"]
        + ["--flavor", "debug", "--seq-len", "32", "--batch", "1", "--reps", "1"]
        + ["--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    candidates = {
        f"{c.kwargs['CHUNK']}x{c.kwargs['BLOCK_C']}/{c.num_warps}w" for c in canon.FORWARD_CONFIGS
    }
    calls = ["A", "B v", "D", "b (Mamba2)"]
    assert [r["call"] for r in rows] == [c for c in calls for _ in canon.FORWARD_CONFIGS]
    for call in calls:
        mine = [r for r in rows if r["call"] == call]
        assert {r["config"] for r in mine} == candidates
        (current,) = [r["config"] for r in mine if r["current"]]
        blocks = canon.FORWARD_BLOCKS
        assert current == f"{blocks['CHUNK']}x{blocks['BLOCK_C']}/{blocks['num_warps']}w"
    assert "Canon forward kernels by block configuration" in proc.stdout
