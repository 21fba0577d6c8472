"""Packed documents through the Canon op with ``positions`` (each token's position in its document):
outputs and every gradient equal each document run alone, on every backend; without positions the op
is what it was (one document's positions give the same bits as none)."""

import pytest
import torch

from canon_titan.kernels.backends import triton_runs_here
from canon_titan.kernels.canon import canon_conv, canon_swiglu
from canon_titan.models.common.canon import CanonConv
from canon_titan.models.common.norms import RMSNorm
from kernel_paths import DEVICE, kernel_path, randn

LENGTHS = ((5, 1, 13, 2), (21,))
"""Documents of each batch row: shorter and longer than the taps, a one-token document."""

BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not triton_runs_here(), reason="needs a GPU or TRITON_INTERPRET=1"
        ),
    ),
]


def document_positions(lengths=LENGTHS) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(DEVICE)


def _leaves(tensors):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]


def packed_and_alone(fn, per_token, shared, dy, lengths=LENGTHS):
    """``fn(*per_token, *shared, positions)`` on the packed batch, and on each document alone
    (batch 1, no positions): outputs and the gradients of every input, those of the documents put
    back in place (per-token tensors) or summed (``shared``: weights, scales, biases)."""
    leaves = _leaves(per_token + shared)
    out = fn(*leaves, positions=document_positions(lengths))
    packed = [out, *torch.autograd.grad(out, [t for t in leaves if t is not None], dy)]
    outs, token_grads = [], [[] for _ in per_token]
    shared_grads = [0.0 for t in shared if t is not None]
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            doc = _leaves([t[b : b + 1, start : start + n] for t in per_token] + shared)
            y = fn(*doc, positions=None)
            doc_dy = dy[b : b + 1, start : start + n]
            grads = torch.autograd.grad(y, [t for t in doc if t is not None], doc_dy)
            outs.append((b, y))
            for i in range(len(per_token)):
                token_grads[i].append(grads[i])
            shared_grads = [s + g for s, g in zip(shared_grads, grads[len(per_token) :])]
            start += n
    rows = len(lengths)
    alone = [torch.cat([torch.cat([y for r, y in outs if r == b], 1) for b in range(rows)])]
    for grads in token_grads:
        per_row, i = [], 0
        for row in lengths:
            per_row.append(torch.cat(grads[i : i + len(row)], 1))
            i += len(row)
        alone.append(torch.cat(per_row))
    return packed, alone + shared_grads


def _assert_equal_lists(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


OPTIONS = [  # kernel, residual, activation, bias, fused norm
    (4, True, False, False, True),  # Canon-A/B/C as LlamaCanon uses them
    (4, True, False, False, False),  # Canon-B on v
    (3, False, True, True, False),  # the linear models' short convolutions
    (2, True, True, True, True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kernel, residual, activation, bias, norm", OPTIONS)
def test_packed_documents_convolve_as_each_document_alone(
    backend, kernel, residual, activation, bias, norm
):
    gen = torch.Generator().manual_seed(0)
    seq, channels = sum(LENGTHS[0]), 24
    x, dy = randn(gen, 2, seq, channels), randn(gen, 2, seq, channels)
    w = randn(gen, channels, kernel)
    b = randn(gen, channels) if bias else None
    row_scale = (torch.rand(2, seq, generator=gen) + 0.5).to(DEVICE) if norm else None
    col_scale = randn(gen, channels) if norm else None
    per_token = [x, row_scale] if norm else [x]

    def fn(x, *rest, positions):
        rs, (w, b, cs) = (rest[0], rest[1:]) if norm else (None, (*rest, None))
        return canon_conv(
            x,
            w,
            b,
            row_scale=rs,
            col_scale=cs,
            residual=residual,
            activation=activation,
            positions=positions,
            backend=backend,
        )

    backward = "canon_conv_weight_grads" if norm and not activation else "canon_conv_backward"
    ops = ("canon_conv", backward) if backend == "triton" else ()
    with kernel_path(*ops):
        packed, alone = packed_and_alone(fn, per_token, [w, b, col_scale] if norm else [w, b], dy)
    _assert_equal_lists(packed, alone)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kernel, bias", [(4, False), (3, True)])
def test_packed_documents_through_canon_d_and_swiglu_as_each_alone(backend, kernel, bias):
    gen = torch.Generator().manual_seed(0)
    seq, hidden = sum(LENGTHS[0]), 20
    gate, up, dy = (randn(gen, 2, seq, hidden) for _ in range(3))
    w, b = randn(gen, 2 * hidden, kernel), randn(gen, 2 * hidden) if bias else None

    def fn(gate, up, w, b, positions):
        return canon_swiglu(gate, up, w, b, positions=positions, backend=backend)

    ops = ("canon_swiglu", "canon_swiglu_backward") if backend == "triton" else ()
    with kernel_path(*ops):
        packed, alone = packed_and_alone(fn, [gate, up], [w, b], dy)
    _assert_equal_lists(packed, alone)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_documents_positions_give_the_bits_of_none(backend):
    gen = torch.Generator().manual_seed(0)
    x, w = randn(gen, 2, 30, 16), randn(gen, 16, 4)
    gate, up = randn(gen, 2, 30, 8), randn(gen, 2, 30, 8)
    one = torch.arange(30, device=DEVICE).expand(2, 30)
    assert torch.equal(
        canon_conv(x, w, positions=one, backend=backend), canon_conv(x, w, backend=backend)
    )
    assert torch.equal(
        canon_swiglu(gate, up, w, positions=one, backend=backend),
        canon_swiglu(gate, up, w, backend=backend),
    )


def test_the_layer_passes_positions_to_every_entry_point():
    """CanonConv's forward (with its fused norm), segments (Canon-B on q, k, v) and swiglu (Canon-D)
    with positions equal the layer on each document alone."""
    torch.manual_seed(0)
    layer = CanonConv.Config(channels=24, kernel_size=4).build()
    layer.init_states()
    norm = RMSNorm.Config(dim=24, eps=1e-6).build()
    norm.init_states()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    gen = torch.Generator().manual_seed(1)
    seq = sum(LENGTHS[0])
    x, dy = randn(gen, 2, seq, 24), randn(gen, 2, seq, 24)
    calls = {
        "forward": lambda x, positions: layer(x, norm, positions=positions),
        "segments": lambda x, positions: torch.cat(
            layer.segments(
                x[..., :8],
                x[..., 8:16],
                x[..., 16:],
                norms=(norm_8, None, None),
                positions=positions,
            ),
            -1,
        ),
        "swiglu": lambda x, positions: layer.swiglu(x[..., :12], x[..., 12:], positions=positions),
    }
    norm_8 = RMSNorm.Config(dim=8, eps=1e-6).build()
    norm_8.init_states()
    for name, call in calls.items():
        packed, alone = packed_and_alone(call, [x], [], dy if name != "swiglu" else dy[..., :12])
        _assert_equal_lists(packed, alone)
