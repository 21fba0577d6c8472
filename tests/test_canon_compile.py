"""The path a GPU runs, held on the CPU: LlamaCanon's block with the Triton Canon ops compiled by
Inductor for sm_90 (``inductor_bytes.HopperCodegen``: Triton code generated on this CPU, never run),
the ops registered as on a GPU (``torch.library.triton_op``, their kernels traced into the graph),
with ``fullgraph=True`` and dynamic shapes, forward and backward; and each op's fake (its body
traced on fake tensors, what Inductor plans the graph with) against the torch backend's outputs and
gradients."""

import json
import os
import subprocess
import sys

from conftest import REPO

_TRACE = """
import json, sys
from collections import Counter

import torch

sys.path.insert(0, "scripts/benchmarks")
from inductor_bytes import HopperCodegen

import model_registry
from canon_titan.kernels import canon

codegen = HopperCodegen()
# CPU tensors take the Triton kernels here: Inductor generates their launches, none runs.
canon._use_triton = lambda backend, x, k: backend == "triton" and k in canon.TRITON_KERNEL_SIZES
spec = model_registry.model_spec("llama_canon", "debug", {"canon_backend": "triton", "n_layers": 1})
torch.set_default_dtype(torch.bfloat16)
torch.manual_seed(0)
block = spec.model.build().layers["0"]
compiled = torch.compile(block, fullgraph=True, dynamic=True)
bodies = {fn.__code__ for fn in (canon.conv_forward, canon.conv_backward, canon.conv_weight_grads,
                                 canon.swiglu_forward, canon.swiglu_backward)}
calls = Counter()


def count_bodies(frame, event, arg):
    if event == "call" and frame.f_code in bodies:
        calls[frame.f_code.co_name] += 1


launches = []
for step, (batch, seq) in enumerate(((2, 40), (3, 72))):
    x = torch.randn(batch, seq, 128, requires_grad=True)
    codegen.launches.clear()
    sys.setprofile(count_bodies if step else None)
    try:
        y = compiled(x)
        y.backward(torch.ones_like(y))
    finally:
        sys.setprofile(None)
    launches.append(sorted(name for name, _ in codegen.launches if name.startswith("_canon")))

# The fakes (each op's body on fake tensors) against the torch backend on the same fake inputs.
from torch._subclasses.fake_tensor import FakeTensorMode

def meta(tensors):
    return [(tuple(t.shape), tuple(t.stride()), str(t.dtype)) for t in tensors]

fakes = {}
with FakeTensorMode():
    x, u, dy = (torch.randn(3, 72, 96) for _ in range(3))
    rs, cs = torch.rand(3, 72, dtype=torch.float32), torch.randn(96)
    w, w2, b = torch.randn(96, 4), torch.randn(192, 3), torch.randn(192)
    positions = torch.arange(72).expand(3, 72)
    cases = {
        "fused norm": (lambda x, w, rs, cs, backend: canon.canon_conv(
            x, w, row_scale=rs, col_scale=cs, backend=backend), [x, w, rs, cs]),
        "silu, bias, positions": (lambda x, w, b, backend: canon.canon_conv(
            x, w, b, activation=True, positions=positions, backend=backend), [x, w2[:96], b[:96]]),
        "swiglu": (lambda g, u, w, b, backend: canon.canon_swiglu(
            g, u, w, b, positions=positions, backend=backend), [x, u, w2, b]),
    }
    for name, (fn, inputs) in cases.items():
        for backend in ("triton", "torch"):
            leaves = [t.detach().requires_grad_() for t in inputs]
            out = fn(*leaves, backend=backend)
            fakes[f"{name} {backend}"] = meta([out, *torch.autograd.grad(out, leaves, dy)])
print(json.dumps({"graphs": len(codegen.graphs), "launches": launches, "body_calls": dict(calls),
                  "fakes": fakes}))
"""

CANON_LAUNCHES = sorted(
    ["_canon_fwd_kernel"] * 5
    + ["_canon_bwd_kernel"] * 5
    + ["_canon_swiglu_fwd_kernel", "_canon_swiglu_bwd_kernel"]
)
"""One block's step: Canon-A, B on q, k and v, C forward and backward, and Canon-D fused with
SwiGLU."""


def test_the_gpus_compiled_block_is_one_graph_pair_for_every_shape_with_the_canon_kernels_in_it():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the GPU's registration
    proc = subprocess.run(
        [sys.executable, "-c", _TRACE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # One forward and one backward graph for both shapes (a symbolic batch and a symbolic sequence
    # that is not a multiple of any block): no graph break, no recompilation.
    assert result["graphs"] == 2
    assert result["launches"] == [CANON_LAUNCHES, CANON_LAUNCHES]
    # The kernels are launched from Inductor's code: no Python body of an op runs in a compiled
    # step.
    assert result["body_calls"] == {}
    fakes = result["fakes"]
    for name in ("fused norm", "silu, bias, positions", "swiglu"):
        assert fakes[f"{name} triton"] == fakes[f"{name} torch"], name
