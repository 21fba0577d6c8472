"""The Canon kernels' instruction economy held at its figures: each Canon call of a LlamaCanon-1B
layer at the recipe's 8 x 4096, compiled for sm_90 (no GPU) at the configuration it runs with,
executes ``FIGURES``' SASS instructions per element, and its issue-bound time (at 100% issue) stands
in that ratio to its memory-bound time (at 80% of the H200's HBM). A kernel change that adds
instructions fails here; one that removes them fails too, saying the figure to write: update
``FIGURES`` from ``CANON_TITAN_FULL_AUTOTUNE=1 scripts/benchmarks/kernel_cost.py guard`` (which
also picks each forward call's configuration among ``FORWARD_CONFIGS``) in the same change.
docs/benchmarks/kernels.md has the table with its times.

The forward kernels run with fixed blocks (``canon.FORWARD_BLOCKS``, not autotuned, so that
every rank of a job runs the same); they are held here to be the candidate the instrument finds
fastest."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

WALK = "BLOCK_C=128, CHUNK=64, STREAMS=1, U=4, 1 warps, 3 stages"
"""The forward calls' configuration: ``FORWARD_BLOCKS``, the candidate of ``FORWARD_CONFIGS`` that
``kernel_cost.py guard`` picks at every forward call."""
FIGURES = {
    # call of the layer: (kernel, configuration, SASS instructions per element, issue / memory time)
    "canon_conv, 2048 ch, fused norm": ("_canon_fwd_kernel", WALK, 15.67, 0.463),
    "canon_conv, 2048 ch": ("_canon_fwd_kernel", WALK, 13.13, 0.403),
    "canon_swiglu, 5632 ch": ("_canon_swiglu_fwd_kernel", WALK, 27.18, 0.524),
    "canon_swiglu_backward, 5632 ch": ("_canon_swiglu_bwd_kernel", "", 50.16, 0.59),
    "canon_conv_weight_grads, 2048 ch, fused norm": ("_canon_bwd_kernel", "", 14.24, 0.488),
    "canon_conv_backward, 2048 ch": ("_canon_bwd_kernel", "", 19.21, 0.377),
}

_COUNT = """
import json, sys
sys.path.insert(0, "scripts/benchmarks")
import kernel_cost
from canon_titan.plan import kernel_counts

kernel_counts._as_hopper()
print(json.dumps(kernel_cost.guard_figures(json.loads(sys.argv[1]))))
"""


@pytest.fixture(scope="module")
def counted() -> dict:
    """Each call's figures at the fastest of its configurations by the instrument (the real Triton
    with the forward kernels autotuned, in a process of its own; code compiled before taken from
    the kernel cost cache, kept by compile key)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CANON_TITAN_FULL_AUTOTUNE"] = "1"
    pinned = {variant: None for variant in FIGURES}
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT, json.dumps(pinned)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", list(FIGURES))
def test_a_canon_kernel_executes_no_more_instructions_than_its_figure(counted, variant):
    kernel, _, per_element, ratio = FIGURES[variant]
    assert variant in counted, f"the layer no longer makes a {variant} call: update FIGURES"
    got_kernel, _, got_per_element, got_ratio = counted[variant]
    assert got_kernel == kernel, f"{variant} runs {got_kernel} now: update FIGURES"
    assert got_per_element <= per_element * 1.005, (
        f"{variant}: {got_per_element} SASS instructions per element, more than FIGURES' "
        f"{per_element}"
    )
    assert got_per_element >= per_element * 0.995, (
        f"{variant}: {got_per_element} SASS instructions per element, fewer than FIGURES' "
        f"{per_element}: write {got_per_element} and issue / memory {got_ratio} there"
    )
    assert got_ratio == pytest.approx(ratio, rel=0.01), (
        f"{variant}: issue / memory time {got_ratio}, FIGURES has {ratio}"
    )


@pytest.mark.parametrize("variant", [v for v in FIGURES if FIGURES[v][1]])
def test_the_fixed_forward_blocks_are_the_fastest_candidate_by_the_instrument(counted, variant):
    """Every forward call of the layer runs ``FORWARD_BLOCKS``; of ``FORWARD_CONFIGS``, the compiled
    kernels' cost finds no faster one. (Most tie, memory-bound; the instrument picks the first of
    equals, so ``FORWARD_BLOCKS`` is held to be the list's first.)"""
    from canon_titan.kernels.canon import FORWARD_BLOCKS, FORWARD_CONFIGS

    first = FORWARD_CONFIGS[0]
    assert {**first.kwargs, "num_warps": first.num_warps} == FORWARD_BLOCKS
    fixed = dict(FORWARD_BLOCKS)
    warps = fixed.pop("num_warps")
    label = ", ".join(f"{k}={v}" for k, v in fixed.items()) + f", {warps} warps, 3 stages"
    assert label == WALK
    assert counted[variant][1] == WALK, (
        f"{variant}: the instrument's fastest forward configuration is {counted[variant][1]}, "
        f"FORWARD_BLOCKS runs {WALK}"
    )


_LAUNCHED = """
import json, os, sys, torch
from canon_titan.kernels import aot, canon
from triton.runtime.autotuner import Autotuner

def launched():
    x = torch.empty(2, 64, 256, device="meta")
    w = torch.empty(256, 4, device="meta")
    (launch,) = aot.record_launches(
        lambda: canon.conv_forward(x, w, None, None, None, True, False)
    )
    kernel, _, kwargs = launch
    keys = ("BLOCK_C", "CHUNK", "STREAMS", "U", "num_warps")
    return type(kernel).__name__, {k: kwargs[k] for k in keys if k in kwargs}

out = {"default": launched()}
if not isinstance(canon._canon_fwd_kernel, Autotuner):
    canon.FORWARD_BLOCKS = {**canon.FORWARD_BLOCKS, "BLOCK_C": 256, "num_warps": 2}
    out["swept"] = launched()
print(json.dumps(out))
"""


@pytest.mark.parametrize("autotune", ["", "1"])
def test_a_forward_launch_passes_the_fixed_blocks_and_autotunes_only_when_asked(autotune):
    """Without the interpreter (a GPU's path, on meta tensors): the forward kernel is launched bare
    with ``FORWARD_BLOCKS`` (the same on every rank; Inductor has nothing to autotune), and a value
    the block sweep sets reaches the launch; with ``CANON_TITAN_FULL_AUTOTUNE=1`` it is an autotuner
    over ``FORWARD_CONFIGS`` and the launch passes no blocks."""
    from canon_titan.kernels.canon import FORWARD_BLOCKS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CANON_TITAN_FULL_AUTOTUNE"] = autotune
    proc = subprocess.run(
        [sys.executable, "-c", _LAUNCHED], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if autotune:
        assert got == {"default": ["Autotuner", {}]}
    else:
        assert got["default"] == ["JITFunction", FORWARD_BLOCKS]
        assert got["swept"] == ["JITFunction", {**FORWARD_BLOCKS, "BLOCK_C": 256, "num_warps": 2}]
