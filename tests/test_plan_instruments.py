"""The planner's accounting held to instruments it does not use itself.

The FLOP formulas ``canon_titan/plan/flops.py`` registers for the custom ops (the Canon convolution,
GLA, the gated delta rule, the Mamba2 SSD) are the only FLOP counts of a plan that PyTorch does not
provide. Each is held here to PyTorch's ``FlopCounterMode`` counting the op's torch backend (the
reference implementation in ``canon_titan/kernels``) forward and backward, on real CPU tensors, at
shapes of the 1B models, where the op is all the work. The plan's side is the custom op itself on
fake tensors under the same counter, which reads the registered formula, as a plan does.

What the torch backends compute differs from the fused GPU kernels the formulas describe in known
ways, hence the tolerances: the fla and mamba-ssm backwards recompute the chunk states that
autograd saves for the torch backend (+10 to +25% backward); the torch GLA kernel also multiplies
the intra-sub-chunk scores by v as one more product (-4% forward); the torch gated delta rule
solves its triangular system with ``solve_triangular`` (counted by the textbook n^2 per right-hand
side, which PyTorch leaves uncounted) where fla multiplies by the inverse (+10% forward). A formula
off by a term, a factor of 2 or a wrong chunk length leaves these bounds. The CPU flash-attention
op's formulas (registered there too) are held to attention written as matmuls. The names the
planner patches in torch and TorchTitan are pinned in ``tests/test_upstream.py``; here, that it puts
them back.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import canon_titan.plan.flops  # noqa: F401  (registers the formulas, as a plan does)

aten, ops = torch.ops.aten, torch.ops.canon_titan


def _solve_triangular_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Forward substitution: n^2 multiply-adds' worth (n(n-1)/2 of them, 2 FLOPs each, plus the
    diagonal) per right-hand side column. PyTorch's counter has no formula for it."""
    n, columns = a_shape[-1], b_shape[-1]
    return math.prod(b_shape[:-2]) * n * n * columns


REFERENCE = {aten.linalg_solve_triangular: _solve_triangular_flops}


def _forward_backward_flops(fn, tensors, custom=None) -> tuple[int, int]:
    """FLOPs FlopCounterMode counts for fn(*tensors) and for the backward of its sum."""
    for t in tensors:
        t.requires_grad_(True)
    with FlopCounterMode(display=False, custom_mapping=custom or {}) as counter:
        out = fn(*tensors)
        forward = counter.get_total_flops()
        out.float().sum().backward()
    return forward, counter.get_total_flops() - forward


def _planned(fn, make) -> tuple[int, int]:
    """The same count for the custom op on fake tensors: what the registered formula says."""
    with FakeTensorMode():
        return _forward_backward_flops(fn, make())


def _within(planned, reference, forward_tol, backward_tol):
    ratios = [p / r for p, r in zip(planned, reference)]
    assert abs(ratios[0] - 1) < forward_tol and abs(ratios[1] - 1) < backward_tol, (
        f"planned / FlopCounterMode on the torch backend: forward {ratios[0]:.3f}, "
        f"backward {ratios[1]:.3f}"
    )
    return ratios


# ----------------------------------------------------------------------------- Canon


def _conv_by_taps(x, weight):
    """The Canon convolution (no bias, no residual, no activation) as one batched matmul per
    channel over the K shifted copies of x: what PyTorch's counter can see (the torch backend's
    shifted multiply-adds are elementwise ops, which it does not count)."""
    kernel = weight.shape[-1]
    windows = F.pad(x, (0, 0, kernel - 1, 0)).unfold(1, kernel, 1)  # [B, T, C, K]
    return torch.einsum("btck,ck->btc", windows, weight)


@pytest.mark.parametrize("batch,seq_len,channels,kernel", [(2, 512, 256, 4), (1, 1024, 128, 2)])
def test_canon_formulas_are_what_the_convolution_computes(batch, seq_len, channels, kernel):
    """canon_conv and canon_swiglu (forward: 2 K FLOPs per element and convolution; backward: the
    input and the weight gradient, 2 K each) against FlopCounterMode on the convolution computed
    as matmuls, which gives the torch backend's output and gradients."""
    from canon_titan.kernels.canon import _canon_torch

    x, weight = (
        torch.randn(batch, seq_len, channels, dtype=torch.float64),
        torch.randn(channels, kernel, dtype=torch.float64),
    )
    # The reference computes the torch backend's convolution, and its autograd the same gradients.
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = _canon_torch(xs, ws, None, residual=False, activation=False)
    expected.sum().backward()
    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    got = _conv_by_taps(xr, wr)
    got.sum().backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close((xr.grad, wr.grad), (xs.grad, ws.grad))

    reference = _forward_backward_flops(_conv_by_taps, [x, weight])
    planned = _planned(
        lambda x, w: ops.canon_conv(x, w, None, None, None, False, False),
        lambda: [torch.empty(batch, seq_len, channels), torch.empty(channels, kernel)],
    )
    _within(planned, reference, 1e-9, 1e-9)

    def swiglu(gate, up, w):
        return F.silu(_conv_by_taps(gate, w[:channels])) * _conv_by_taps(up, w[channels:])

    reference = _forward_backward_flops(swiglu, [x, x.clone(), torch.cat([weight, weight])])
    planned = _planned(
        lambda g, u, w: ops.canon_swiglu(g, u, w, None, False, True),
        lambda: [
            torch.empty(batch, seq_len, channels),
            torch.empty(batch, seq_len, channels),
            torch.empty(2 * channels, kernel),
        ],
    )
    _within(planned, reference, 1e-9, 1e-9)


# ----------------------------------------------------------------------------- the recurrences


@pytest.mark.parametrize("heads,dk,dv", [(2, 128, 128), (2, 64, 256)])
def test_gla_formula_against_its_torch_backend(heads, dk, dv):
    from canon_titan.kernels.gla import _fla_chunk_size, _gla_torch

    batch, seq_len = 1, 512
    chunk = _fla_chunk_size(seq_len)

    def make():
        return [
            torch.randn(batch, seq_len, heads, dk),
            torch.randn(batch, seq_len, heads, dk),
            torch.randn(batch, seq_len, heads, dv),
            F.logsigmoid(torch.randn(batch, seq_len, heads, dk)) / 16,
        ]

    reference = _forward_backward_flops(
        lambda q, k, v, g: _gla_torch(q, k, v, g, 0.1, chunk, None)[0], make()
    )
    planned = _planned(lambda q, k, v, g: ops.fla_chunk_gla(q, k, v, g, None, 0.1, False)[0], make)
    _within(planned, reference, 0.10, 0.20)


@pytest.mark.parametrize("heads,dk,dv", [(2, 128, 256), (2, 128, 128)])
def test_gated_delta_rule_formula_against_its_torch_backend(heads, dk, dv):
    from canon_titan.kernels.delta_rule import FLA_CHUNK_SIZE, _gated_delta_rule_torch

    batch, seq_len = 1, 512

    def make():
        return [
            F.normalize(torch.randn(batch, seq_len, heads, dk), dim=-1),
            F.normalize(torch.randn(batch, seq_len, heads, dk), dim=-1),
            torch.randn(batch, seq_len, heads, dv),
            -torch.rand(batch, seq_len, heads),
            torch.rand(batch, seq_len, heads),
        ]

    reference = _forward_backward_flops(
        lambda q, k, v, g, b: _gated_delta_rule_torch(q, k, v, g, b, 0.1, FLA_CHUNK_SIZE, None)[0],
        make(),
        REFERENCE,
    )
    planned = _planned(
        lambda q, k, v, g, b: ops.fla_chunk_gated_delta_rule(q, k, v, g, b, None, 0.1, False)[0],
        make,
    )
    _within(planned, reference, 0.15, 0.25)


@pytest.mark.parametrize(
    "heads,groups,head_dim,state,chunk", [(2, 1, 256, 128, 256), (4, 2, 64, 128, 128)]
)
def test_ssd_formula_against_its_torch_backend(heads, groups, head_dim, state, chunk):
    from canon_titan.kernels.ssd import _ssd_torch

    batch, seq_len = 1, 2 * chunk

    def make():
        return [
            torch.randn(batch, seq_len, heads, head_dim),
            torch.rand(batch, seq_len, heads) / 10,
            -torch.rand(heads),
            torch.randn(batch, seq_len, groups, state),
            torch.randn(batch, seq_len, groups, state),
        ]

    reference = _forward_backward_flops(
        lambda x, dt, A, B, C: _ssd_torch(x, dt, A, B, C, None, chunk, None)[0], make()
    )
    planned = _planned(
        lambda x, dt, A, B, C: ops.mamba_chunk_scan(x, dt, A, B, C, None, None, chunk, False)[0],
        make,
    )
    _within(planned, reference, 0.02, 0.20)


def test_the_document_ops_are_priced_as_the_kernels_they_run():
    """With document boundaries the recurrences run the same kernels over the same chunks (the batch
    flattened to one row for fla): each document op's formula counts what its plain op's does for
    one document a row, which the tests above hold to FlopCounterMode on the torch backends; and the
    planner prices them as recurrences."""
    from canon_titan.kernels.documents import Documents, one_document_a_row
    from canon_titan.plan.flops import op_kind

    batch, seq_len, heads, dk, dv = 2, 256, 2, 64, 128

    def fla(*shapes):
        return lambda: [torch.randn(*shape) for shape in shapes]

    qkv = [(batch, seq_len, heads, dk), (batch, seq_len, heads, dk), (batch, seq_len, heads, dv)]
    flat = [(1, batch * seq_len, *shape[2:]) for shape in qkv]

    def boundaries():  # made inside the fake mode, as the planner's batches are
        return (*one_document_a_row(batch, seq_len).values(), torch.arange(seq_len).repeat(batch))

    def seq_idx():
        return Documents(torch.arange(seq_len).expand(batch, -1)).seq_idx()

    ssd_make = fla(
        (batch, seq_len, heads, dv),
        (batch, seq_len, heads),
        (heads,),
        (batch, seq_len, 1, 32),
        (batch, seq_len, 1, 32),
    )
    pairs = [
        (
            lambda q, k, v, g: ops.fla_chunk_gla(q, k, v, g, None, 0.1, False)[0],
            fla(*qkv, qkv[0]),
            lambda q, k, v, g: ops.fla_chunk_gla_documents(q, k, v, g, 0.1, False, *boundaries())[
                0
            ],
            fla(*flat, flat[0]),
        ),
        (
            lambda q, k, v, g, b: ops.fla_chunk_gated_delta_rule(q, k, v, g, b, None, 0.1, False)[
                0
            ],
            fla(*qkv, qkv[0][:3], qkv[0][:3]),
            lambda q, k, v, g, b: ops.fla_chunk_gated_delta_rule_documents(
                q, k, v, g, b, 0.1, False, *boundaries()[:2]
            )[0],
            fla(*flat, flat[0][:3], flat[0][:3]),
        ),
        (
            lambda x, dt, A, B, C: ops.mamba_chunk_scan(x, dt, A, B, C, None, None, 64, False)[0],
            ssd_make,
            lambda x, dt, A, B, C: ops.mamba_chunk_scan_documents(
                x, dt, A, B, C, None, 64, False, seq_idx()
            )[0],
            ssd_make,
        ),
    ]
    for plain, plain_inputs, documents, document_inputs in pairs:
        assert _planned(documents, document_inputs) == _planned(plain, plain_inputs)
    for name in ("fla_chunk_gla", "fla_chunk_gated_delta_rule", "mamba_chunk_scan"):
        for op in (f"{name}_documents", f"{name}_documents_backward"):
            assert op_kind(getattr(ops, op)) == "recurrence", op


# ----------------------------------------------------------------------------- what the plan
# patches


def test_the_patches_are_undone():
    """After a pipeline stage's patches and a recorder's, the classes hold torch's own methods
    again."""
    from torch.distributed.pipelining.stage import PipelineStage
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    from canon_titan.plan.fake_world import pipeline_without_peers
    from canon_titan.plan.recorder import StepRecorder
    from test_upstream import PATCHED

    names = [
        p[1].split(".")[1]
        for p in PATCHED
        if p[1].startswith("PipelineStage.") and p[3] == "plan/fake_world.py"
    ]
    before = {n: PipelineStage.__dict__[n] for n in names}
    resize, propagate = (
        torch.UntypedStorage.resize_,
        ShardingPropagator._propagate_tensor_meta_non_cached,
    )
    recorder = StepRecorder()
    with pipeline_without_peers({}, recorder), recorder:
        assert all(PipelineStage.__dict__[n] is not before[n] for n in names)
        assert torch.UntypedStorage.resize_ is not resize
    assert {n: PipelineStage.__dict__[n] for n in names} == before
    assert torch.UntypedStorage.resize_ is resize
    assert ShardingPropagator._propagate_tensor_meta_non_cached is propagate


# ----------------------------------------------------------------------------- CPU attention


def test_cpu_flash_attention_formulas_against_attention_as_matmuls():
    """The CPU flash-attention op a plan on CPU tensors dispatches (where a GPU run calls the CUDA
    kernel) is counted by the formulas flops.py registers for it; held here to attention written as
    its two matmuls under FlopCounterMode: the forward equal, the backward its four gradient
    products plus the scores recomputed (half the forward), as flash kernels do."""
    batch, heads, seq_len, head_dim = 2, 4, 256, 64

    def as_matmuls(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / head_dim**0.5, dim=-1) @ v

    def make():
        return [torch.randn(batch, heads, seq_len, head_dim) for _ in range(3)]

    tensors = make()
    torch.testing.assert_close(
        F.scaled_dot_product_attention(*tensors), as_matmuls(*tensors), atol=1e-5, rtol=1e-4
    )
    reference = _forward_backward_flops(as_matmuls, make())
    planned = _forward_backward_flops(F.scaled_dot_product_attention, make())
    assert planned == (reference[0], reference[1] + reference[0] // 2), (planned, reference)
