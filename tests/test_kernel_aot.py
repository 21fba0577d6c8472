"""The Canon op's Triton kernels compiled ahead of time for sm_90 (H100/H200), with no GPU here, by
the venv's Triton and by the GPU image's (3.6.0, which scripts/test.sh installs aside in
.venv/triton36): every configuration a launch may use compiles, none spills registers, and
Mamba2-3B's short convolution, whose input rows are 12568 elements apart (not a multiple of 16),
loads like its twin with aligned rows (16-byte vector loads, not 2-byte scalar ones). Compiled with
``CANON_TITAN_FULL_AUTOTUNE=1``: the forward kernels' every candidate, not only the fixed blocks."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

TRITON_36 = REPO / ".venv" / "triton36"


@pytest.fixture(scope="module", params=["pinned", "3.6.0"])
def compiled(request, tmp_path_factory) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CANON_TITAN_FULL_AUTOTUNE"] = "1"
    if request.param == "3.6.0":
        if not (TRITON_36 / "triton" / "__init__.py").exists():
            pytest.skip(
                f"Triton 3.6.0 is not installed in {TRITON_36} (scripts/test.sh installs it)"
            )
        env["PYTHONPATH"] = os.pathsep.join([str(TRITON_36), str(REPO), env.get("PYTHONPATH", "")])
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "canon_titan.kernels.aot", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    if request.param == "3.6.0":
        assert result["triton"] == "3.6.0"
    return result


def test_every_configuration_compiles_without_spills(compiled):
    from canon_titan.kernels.canon import FORWARD_CONFIGS

    kernels = compiled["kernels"]
    spilling = [k for k in kernels if k["spills"] or k["registers"] > 255]
    assert not spilling, spilling
    names = {k["kernel"] for k in kernels}
    assert names == {
        "_canon_fwd_kernel",
        "_canon_bwd_kernel",
        "_canon_swiglu_fwd_kernel",
        "_canon_swiglu_bwd_kernel",
    }
    forward = {(k["case"], k["config"]) for k in kernels if k["kernel"] == "_canon_fwd_kernel"}
    configs = {f"{c.kwargs['CHUNK']}x{c.kwargs['BLOCK_C']}/{c.num_warps}w" for c in FORWARD_CONFIGS}
    assert {config for _, config in forward} == configs


def test_no_kernel_waits_at_a_barrier_inside_its_loop(compiled):
    """The backward kernels reduce the weight gradient across rows once per chunk, not on every tile
    and tap (2026-11-26, H200: 3 and 6 barriers an iteration ran them at a twelfth of the
    bandwidth)."""
    looping = [
        (k["kernel"], k["config"], k["loop_barriers"])
        for k in compiled["kernels"]
        if k["loop_barriers"]
    ]
    assert not looping, looping


def test_backward_kernels_load_each_input_row_once(compiled):
    """The backward kernels walk the sequence U rows an iteration and load each input row once: the
    SwiGLU backward gate, up and dy, the short convolution's x and dy (its SiLU recomputed from the
    rows carried in registers). Each of the K shifted tiles loaded on its own issued 62 and 34 loads
    an iteration, a window of tiles 18 and 11."""
    from canon_titan.kernels.aot import ALIGNED_TWIN
    from canon_titan.kernels.canon import BACKWARD_BLOCKS, SWIGLU_BACKWARD_BLOCKS

    loads = {
        (k["case"], k["kernel"]): k["loop_loads"]
        for k in compiled["kernels"]
        if "bwd" in k["kernel"]
    }
    # the SwiGLU backward's loop is unrolled twice: 2U rows in its body and U in the remainder's
    u_rows = 3 * SWIGLU_BACKWARD_BLOCKS["U"]  # gate, up and dy
    assert loads[("D 8B, swiglu", "_canon_swiglu_bwd_kernel")] == 3 * u_rows
    assert loads[(ALIGNED_TWIN, "_canon_bwd_kernel")] == 2 * BACKWARD_BLOCKS["U"]


def test_loop_barrier_count_against_hand_written_ptx():
    from canon_titan.kernels.aot import loop_barriers, loop_loads

    ptx = """
    bar.sync 0;
$L__BB0_1:                              // loop header
    ld.global.b32 %r1, [%rd1];
    bar.sync 0;
$L__BB0_2:                              // inner loop
    bar.sync 0;
    @%p1 bra $L__BB0_2;
    @%p2 bra $L__BB0_1;
    bar.sync 0;
    @%p3 bra $L__BB0_3;
$L__BB0_3:
    bar.sync 0;
    ret;
"""
    assert (
        loop_barriers(ptx) == 2
    )  # the two inside BB0_1's loop (one of them in the nested loop too)
    assert loop_loads(ptx) == 1


def test_misaligned_rows_load_like_aligned_ones(compiled):
    from canon_titan.kernels.aot import ALIGNED_TWIN, MISALIGNED

    def loads(case):
        return {
            (k["kernel"], k["config"]): (k["vector_loads"], k["scalar_2byte_loads"])
            for k in compiled["kernels"]
            if k["case"] == case
        }

    misaligned, aligned = loads(MISALIGNED), loads(ALIGNED_TWIN)
    assert misaligned and misaligned == aligned


# Canon-D's backward at its own configuration (about 136 registers a thread) held to 64 registers
# a thread with ptxas's ``maxnreg``, compiled through aot's own path, the backward kernel alone: one
# compile of a configuration that spills, where compiling a tile too large for the registers took
# ptxas minutes.
_FORCED_TILE = """
import json
from canon_titan.kernels import aot, sass
aot.configs_of = lambda launch: [sass.Config({**c.kwargs, "maxnreg": 64}, c.label)
                                 for c in launch.configs()] if "bwd" in launch.name else []
cases = {k: v for k, v in aot.model_cases().items() if k.startswith("D 8B")}
results = aot.compile_all(cases=cases)
print(json.dumps([{"kernel": r.kernel, "config": r.config, "registers": r.registers,
                   "spills": r.spills, "spill_load_bytes": r.spill_load_bytes} for r in results]))
"""


def test_the_check_reports_a_spilling_configuration():
    """The no-spill test above can fail: a configuration held to fewer registers than the kernel
    needs is reported spilling."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _FORCED_TILE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (backward,) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert backward["kernel"] == "_canon_swiglu_bwd_kernel" and backward["config"] == "512x64/1w"
    assert backward["registers"] <= 64 and backward["spills"] and backward["spill_load_bytes"] > 0
