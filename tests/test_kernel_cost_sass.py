"""The SASS counter (``canon_titan/kernels/sass.py``, ``trips.py``) against hand counts: small
Triton
kernels written here, compiled for sm_90 with the bundled ptxas and nvdisasm (no GPU), whose loops,
early returns and instructions per element follow from their source; a hand-written TTGIR for the
trip-count evaluator; a kernel forced to spill, seen by ptxas's report and in the SASS alike."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


def _counted(*names: str) -> dict:
    """``tests/sass_kernels.py``'s counts, compiled by the real Triton (not its interpreter, which
    conftest turns on) in a process of its own."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "sass_kernels.py"), *names],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def every_config() -> dict:
    return _counted("looped", "triangular", "nested", "exp_affine", "wide")


@pytest.fixture(scope="module")
def counted(every_config) -> dict:
    return {name: configs[0] for name, configs in every_config.items()}


# The loops' tiles are one fp32 per thread per load instruction (128 elements on 4 warps), or two
# scalar ones (256 elements at an offset of i * 7: no alignment known). ptxas unrolls such loops
# (four tiles an iteration, a remainder loop after) and peels a few guarded iterations into the
# straight code, which every program is counted to run: within 5% here, at hundreds of iterations.


def test_a_loop_runs_its_trip_count_in_every_program_that_did_not_return(counted):
    """10 programs, 4 returning at once, each of the other 6 looping 200 times over two scalar loads a
    thread: 6 x 200 x 2 load instructions per warp, on 4 warps; the store after the loop by 6
    programs."""
    looped = counted["looped"]
    assert looped["programs"] == 10
    assert looped["executed"]["load"] == pytest.approx(6 * 200 * 2 * 4, rel=0.05)
    assert looped["executed"]["store"] == 6 * 4 * looped["static"]["store"]


def test_a_loop_bounded_by_the_program_id_runs_a_triangle(counted):
    """Program p loads 16 p tiles: 16 (0 + 1 + ... + 63) = 32,256 tiles over the 64 programs, one load
    per warp each."""
    assert counted["triangular"]["executed"]["load"] == pytest.approx(32_256 * 4, rel=0.05)


def test_a_loop_in_a_loop_of_a_constant_trip_count_runs_the_product(counted):
    """4 x 100 tiles in each of 5 programs, whether or not the compilers unrolled either loop."""
    assert counted["nested"]["executed"]["load"] == pytest.approx(4 * 100 * 5 * 4, rel=0.05)


def test_an_exp2_of_an_affine_map_is_one_mufu_and_one_ffma_per_element(counted):
    """exp2(x * a + b) on fp32: one special-function instruction and one fused multiply-add per
    element,
    and its loads vectorised (at most one load per 4 elements)."""
    per = counted["exp_affine"]["per_element"]
    assert per["mufu"] == pytest.approx(1.0)
    assert per["fp32"] == pytest.approx(1.0, abs=0.05)
    assert per["load"] <= 0.25


def test_the_trip_count_evaluator_against_a_hand_written_ttgir():
    """An early return for programs at or past ``limit`` and, in the others, a loop from 0 to the
    program id times 2: with 5 programs and limit 3, survivors 3 and 0 + 2 + 4 = 6 iterations."""
    from canon_titan.kernels.trips import evaluate, skeleton

    ttgir = """
module {
  tt.func public @k(%x: !tt.ptr<f32> loc("x"(#loc)), %limit: i32 loc("limit"(#loc))) {
    %c0_i32 = arith.constant 0 : i32 loc(#loc1)
    %c1_i32 = arith.constant 1 : i32 loc(#loc1)
    %c2_i32 = arith.constant 2 : i32 loc(#loc1)
    %0 = tt.get_program_id x : i32 loc(#loc2)
    %1 = arith.cmpi sge, %0, %limit : i32 loc(#loc3)
    cf.cond_br %1, ^bb1, ^bb2 loc(#loc3)
  ^bb1:  // pred: ^bb0
    tt.return loc(#loc4)
  ^bb2:  // pred: ^bb0
    %2 = arith.muli %0, %c2_i32 : i32 loc(#loc5)
    %3 = scf.for %i = %c0_i32 to %2 step %c1_i32 iter_args(%acc = %c0_i32) -> (i32) : i32 {
      %4 = arith.addi %acc, %i : i32 loc(#loc6)
      scf.yield %4 : i32 loc(#loc6)
    } loc(#loc7)
    tt.return loc(#loc8)
  } loc(#loc)
} loc(#loc)
"""
    trips = evaluate(skeleton(ttgir), {"limit": 3}, (5, 1, 1))
    assert [s for _, s in trips.survivors] == [3.0]
    assert [loop["iterations"] for loop in trips.loops] == [6.0]


def test_a_kernel_held_to_few_registers_spills_in_the_report_and_in_the_sass(every_config):
    """Three 4096-element fp32 tiles on 128 threads need about 96 registers a thread: with
    ``maxnreg`` 32
    ptxas reports spill stores and the SASS holds local-memory instructions; without it, neither."""
    held, free = every_config["wide"]
    assert "32 max registers" in held["label"]
    assert (
        held["registers"] <= 32
        and held["spill_store_bytes"] > 0
        and held["static"].get("local", 0) > 0
    )
    assert (
        free["registers"] > 32
        and free["spill_store_bytes"] == 0
        and not free["static"].get("local")
    )
