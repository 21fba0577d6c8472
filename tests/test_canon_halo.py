"""The Canon op on a context-parallel rank's rows: two runs of the sequence side by side, each read
with the K-1 rows before it from a small halo argument (no copy of the input with the halos in
front). Its output equals the whole sequence's convolution at those rows, and the Triton kernels'
outputs and gradients (of the rows, the halo rows, the weights and the fused norm's scales) equal
the torch backend's, with and without document positions. The trainings under context parallelism
are in ``tests/test_context_parallel.py``."""

import pytest
import torch

from canon_titan.kernels.backends import triton_runs_here
from canon_titan.kernels.canon import canon_conv, canon_swiglu
from kernel_paths import DEVICE, kernel_path, randn

RUNS = ((3, 13), (29, 9))
"""(global start, length) of the rank's two runs of a 40-row sequence."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[:, start : start + length] for start, length in RUNS], dim=1)


def _halo(t: torch.Tensor, kernel: int) -> torch.Tensor:
    return torch.cat([t[:, start - kernel + 1 : start] for start, _ in RUNS], dim=1)


def _documents() -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in (5, 27, 8)]).expand(2, 40).to(DEVICE)


def _grads(fn, tensors, dy, backend):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves, backend=backend)
    return [out, *torch.autograd.grad(out, leaves, dy)]


@pytest.mark.parametrize(
    "kernel, norm, activation", [(4, True, False), (3, False, True), (2, True, True)]
)
@pytest.mark.parametrize("documents", [False, True])
def test_a_ranks_runs_with_their_halos_convolve_as_the_whole_sequence(
    kernel, norm, activation, documents
):
    gen = torch.Generator().manual_seed(0)
    x, w, b = randn(gen, 2, 40, 24), randn(gen, 24, kernel), randn(gen, 24)
    row_scale, col_scale = (torch.rand(2, 40, generator=gen) + 0.5).to(DEVICE), randn(gen, 24)
    positions = _documents() if documents else None
    scales = {"row_scale": row_scale, "col_scale": col_scale} if norm else {}
    whole = _local(canon_conv(x, w, b, activation=activation, positions=positions, **scales))
    # The halo rows as the op reads them: before the column scale (x * row_scale with a fused norm).
    halo = _halo(x.float() * row_scale[..., None] if norm else x, kernel)
    local = {"positions": _local(positions) if documents else None, "split": RUNS[0][1]}

    def fn(x, halo, w, b, *rs, backend):
        scales = {"row_scale": rs[0], "col_scale": col_scale} if norm else {}
        return canon_conv(
            x, w, b, activation=activation, halo=halo, backend=backend, **scales, **local
        )

    inputs = [_local(x), halo, w, b] + ([_local(row_scale)] if norm else [])
    torch.testing.assert_close(fn(*inputs, backend="torch"), whole, rtol=1e-5, atol=1e-5)
    if not triton_runs_here():
        return
    dy = randn(gen, *whole.shape)
    backward = "canon_conv_weight_grads" if norm and not activation else "canon_conv_backward"
    with kernel_path("canon_conv", backward):
        got = _grads(fn, inputs, dy, "triton")
    for g, want in zip(got, _grads(fn, inputs, dy, "torch")):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("documents", [False, True])
def test_canon_d_on_a_ranks_runs_with_their_halos(documents):
    gen = torch.Generator().manual_seed(0)
    gate, up, w, b = randn(gen, 2, 40, 20), randn(gen, 2, 40, 20), randn(gen, 40, 4), randn(gen, 40)
    positions = _documents() if documents else None
    whole = _local(canon_swiglu(gate, up, w, b, positions=positions))
    local = {"positions": _local(positions) if documents else None, "split": RUNS[0][1]}

    def fn(gate, up, halo_gate, halo_up, w, b, backend):
        return canon_swiglu(gate, up, w, b, halo=(halo_gate, halo_up), backend=backend, **local)

    inputs = [_local(gate), _local(up), _halo(gate, 4), _halo(up, 4), w, b]
    torch.testing.assert_close(fn(*inputs, backend="torch"), whole, rtol=1e-5, atol=1e-5)
    if not triton_runs_here():
        return
    dy = randn(gen, *whole.shape)
    with kernel_path("canon_swiglu", "canon_swiglu_backward"):
        got = _grads(fn, inputs, dy, "triton")
    for g, want in zip(got, _grads(fn, inputs, dy, "torch")):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-4)
