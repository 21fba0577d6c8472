"""The bytes a compiled LlamaCanon-1B block moves per token against Llama-1B's, as a GPU runs it
(Inductor's Triton kernels generated for sm_90 on this CPU and not run: its own count of their
bytes, plus the Canon op's kernel launches, ``bench_canon.py --mode bytes``), and the host's part of
it: the Canon ops' kernels launched from Inductor's generated code, without a Python frame of the op
per call."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

CANON_LAUNCHES = sorted(
    ["_canon_fwd_kernel"] * 5
    + ["_canon_swiglu_fwd_kernel", "_canon_swiglu_bwd_kernel"]
    + ["_canon_bwd_kernel"] * 5
)
"""One block's step: Canon-A, B on q, k and v, C forward and backward, and Canon-D fused with
SwiGLU."""


@pytest.mark.slow
def test_llama_canons_block_moves_at_most_five_percent_more_than_llamas_launched_without_python(
    tmp_path,
):
    """At most 1.05x Llama's bytes per token (the Canon ops fuse the norms and SwiGLU they sit next
    to: 1.049x at 2 x 1024, 1.048x at the recipes' 4096, so a pass added anywhere in the block,
    about 4 KB a token at dim 2048, fails it; it was 1.22x before the fused norms' input gradients
    went to Inductor), and per step 12 Canon kernel launches, none through the op's Python body
    (with ``torch.library.custom_op`` each ran its body: 12 Python calls a layer and step). Per
    token the bytes barely depend on the sequence (each launch's weights are shared by fewer
    tokens), and the CPU's attention costs its square: 2 x 1024, not 1 x 4096."""
    out = tmp_path / "bytes.json"
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/benchmarks/bench_canon.py",
            "--mode",
            "bytes",
            "--flavor",
            "1B",
            "--seq-len",
            "1024",
            "--batch",
            "2",
            "--canon-sets",
            "ABCD",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    llama, canon = result["per_token"]["llama"], result["per_token"]["ABCD"]
    assert canon["total"] <= 1.05 * llama["total"], (canon, llama)
    (row,) = [r for r in result["rows"] if r["canon_set"] == "ABCD"]
    assert sorted(name for name, _ in row["canon_launches"]) == CANON_LAUNCHES
    assert row["op_body_calls"] == {}


_KERNELS_OF_OPS = """
import json
import torch._library.triton as library
from canon_titan.kernels import canon
ops = ("canon_conv", "canon_conv_backward", "canon_conv_weight_grads", "canon_swiglu",
       "canon_swiglu_backward")
kernels = {op: library.get_triton_kernels_for_op(f"canon_titan::{op}") for op in ops}
found = {op: [getattr(k, "fn", k).__name__ for k in ks] for op, ks in kernels.items()}
print(json.dumps(found))
"""


def test_each_op_names_its_kernels_to_inductors_caches():
    """On a GPU the ops are ``triton_op``s whose kernels torch finds in their bodies (the literal
    ``wrap_triton(kernel)`` calls): the sources of those kernels are part of the key of Inductor's
    cached graphs, so an edited kernel is compiled again rather than taken from a stale cache."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _KERNELS_OF_OPS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "canon_conv": ["_canon_fwd_kernel"],
        "canon_conv_backward": ["_canon_bwd_kernel"],
        "canon_conv_weight_grads": ["_canon_bwd_kernel"],
        "canon_swiglu": ["_canon_swiglu_fwd_kernel"],
        "canon_swiglu_backward": ["_canon_swiglu_bwd_kernel"],
    }
