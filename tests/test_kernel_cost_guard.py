"""The Canon kernels' instruction economy held at its figures: each Canon call of a LlamaCanon-1B
layer at the recipe's 8 x 4096, compiled for sm_90 (no GPU) at the configuration it runs with,
executes ``FIGURES``' SASS instructions per element, and its issue-bound time (at 100% issue) stands
in that ratio to its memory-bound time (at 80% of the H200's HBM). A kernel change that adds
instructions fails here; one that removes them fails too, saying the figure to write: update
``FIGURES`` from ``scripts/benchmarks/kernel_cost.py guard`` (which also picks each autotuned call's
configuration) in the same change. docs/benchmarks/kernels.md has the table with its times."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

WALK = "BLOCK_C=128, CHUNK=64, STREAMS=1, U=4, 1 warps, 3 stages"
"""The forward calls' configuration (of their autotuning candidates) that ``kernel_cost.py guard``
picks."""
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
    """Each call's figures, only its pinned configuration compiled (the real Triton, in a process of
    its own; code compiled before taken from the kernel cost cache, kept by compile key)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    pinned = {variant: figures[1] for variant, figures in FIGURES.items()}
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
