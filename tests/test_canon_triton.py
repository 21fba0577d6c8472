"""The Triton Canon kernels (run by Triton's interpreter on this CPU) against the torch backend:
outputs and every gradient in float32, the custom-op registration, and compile without graph
breaks. The torch backend itself is checked against hand loops in test_canon.py.

The interpreter's block is 64 rows x 256 channels and the weight-gradient chunk 128 rows, so the
shapes below cover partial blocks in both dimensions, several chunks, and T shorter than K.
"""

import pytest
import torch

import model_registry
from canon_titan.kernels.backends import triton_runs_here
from canon_titan.kernels.canon import canon_conv, canon_swiglu

pytestmark = pytest.mark.skipif(not triton_runs_here(), reason="needs a GPU or TRITON_INTERPRET=1")

# float32; only the summation order differs (tiles, per-chunk partial sums of the weight gradient).
TOL = dict(rtol=1e-5, atol=1e-4)

# batch, seq, channels, kernel, residual, activation, bias
CASES = [
    (2, 37, 300, 4, True, False, False),  # Canon-A/B/C as LlamaCanon uses them
    (1, 300, 5, 3, False, True, True),  # Mamba2's short convolution (no residual, SiLU, bias); 3 chunks
    (2, 130, 600, 2, True, True, True),  # everything on
    (1, 3, 40, 4, True, False, True),  # fewer tokens than taps
    (2, 200, 257, 4, False, True, False),  # GLA5/GDN2 short convolutions; one channel past a block
]


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def _run(fn, tensors, dy, backend):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    out = fn(*leaves, backend=backend)
    grads = torch.autograd.grad(out, [t for t in leaves if t is not None], dy)
    return [out, *grads]


def assert_backends_agree(fn, tensors, seed=1):
    gen = torch.Generator().manual_seed(seed)
    dy = _randn(gen, *tensors[0].shape)
    for got, want in zip(_run(fn, tensors, dy, "triton"), _run(fn, tensors, dy, "torch")):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("batch, seq, channels, kernel, residual, activation, bias", CASES)
def test_canon_conv_triton_equals_torch(batch, seq, channels, kernel, residual, activation, bias):
    gen = torch.Generator().manual_seed(0)
    x, w = _randn(gen, batch, seq, channels), _randn(gen, channels, kernel)
    b = _randn(gen, channels) if bias else None

    def fn(x, w, b, backend):
        return canon_conv(x, w, b, residual=residual, activation=activation, backend=backend)

    assert_backends_agree(fn, [x, w, b])


@pytest.mark.parametrize("batch, seq, channels, kernel, residual, activation, bias", [CASES[0], CASES[2]])
def test_fused_rmsnorm_input(batch, seq, channels, kernel, residual, activation, bias):
    """Canon-A/B/C take the RMSNorm's inverse RMS (per token) and weight (per channel) and scale
    their input inside the kernel; gradients reach x, both scales, the weight and the bias."""
    gen = torch.Generator().manual_seed(0)
    x, w = _randn(gen, batch, seq, channels), _randn(gen, channels, kernel)
    b = _randn(gen, channels) if bias else None
    row_scale, col_scale = torch.rand(batch, seq, generator=gen) + 0.5, _randn(gen, channels)

    def fn(x, w, b, row_scale, col_scale, backend):
        return canon_conv(x, w, b, row_scale=row_scale, col_scale=col_scale, residual=residual,
                          activation=activation, backend=backend)

    assert_backends_agree(fn, [x, w, b, row_scale, col_scale])


@pytest.mark.parametrize("batch, seq, channels, kernel, residual, activation, bias", CASES)
def test_canon_swiglu_triton_equals_torch(batch, seq, channels, kernel, residual, activation, bias):
    gen = torch.Generator().manual_seed(0)
    gate, up = _randn(gen, batch, seq, channels), _randn(gen, batch, seq, channels)
    w = _randn(gen, 2 * channels, kernel)
    b = _randn(gen, 2 * channels) if bias else None

    def fn(gate, up, w, b, backend):
        return canon_swiglu(gate, up, w, b, residual=residual, activation=activation, backend=backend)

    assert_backends_agree(fn, [gate, up, w, b])


def test_non_contiguous_inputs_and_weights():
    """A channel slice of a wider activation, a [B, C, T] buffer seen as [B, T, C], a weight with a
    row stride and a strided bias are read in place."""
    gen = torch.Generator().manual_seed(0)
    sliced = _randn(gen, 2, 70, 400)[:, :, 50:350]
    transposed = _randn(gen, 2, 300, 70).transpose(1, 2)
    weight, bias = _randn(gen, 300, 6)[:, 1:5], _randn(gen, 600)[::2]
    assert not any(t.is_contiguous() for t in (sliced, transposed, weight, bias))

    def conv(x, w, b, backend):
        return canon_conv(x, w, b, residual=True, activation=True, backend=backend)

    def swiglu(g, u, w, backend):
        return canon_swiglu(g, u, w, None, residual=True, activation=False, backend=backend)

    for x in (sliced, transposed):
        assert_backends_agree(conv, [x, weight, bias])
    assert_backends_agree(swiglu, [sliced, transposed, _randn(gen, 600, 6)[:, 1:5]])


def test_bfloat16_stays_close_to_float32():
    gen = torch.Generator().manual_seed(0)
    x, w = _randn(gen, 2, 50, 96), _randn(gen, 96, 4) * 0.5
    exact = canon_conv(x, w, backend="torch")
    got = canon_conv(x.bfloat16(), w.bfloat16(), backend="triton")
    assert got.dtype == torch.bfloat16
    # Inputs rounded to bf16 (~3e-3 relative), accumulated in float32, output rounded once.
    torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("op, args", [
    ("canon_conv", lambda g: (_randn(g, 2, 20, 48), _randn(g, 48, 4), _randn(g, 48), None, None, True, True)),
    ("canon_conv", lambda g: (_randn(g, 2, 20, 48), _randn(g, 48, 2), None, torch.rand(2, 20, generator=g),
                              _randn(g, 48), True, False)),
    ("canon_swiglu", lambda g: (_randn(g, 2, 20, 24), _randn(g, 2, 20, 24), _randn(g, 48, 3), None, True, False)),
])
def test_custom_op_registration(op, args):
    """torch.library's own checks: schema, fake (meta) kernel against the real one, autograd
    registration, and AOT dispatch with dynamic shapes."""
    inputs = args(torch.Generator().manual_seed(0))
    inputs = tuple(t.requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs)
    torch.library.opcheck(getattr(torch.ops.canon_titan, op).default, inputs)


def _block(family, **overrides):
    spec = model_registry.model_spec(family, "debug", {"canon_backend": "triton", **overrides})
    torch.manual_seed(0)
    model = spec.model.build()
    model.init_states()
    return model


@pytest.mark.parametrize("family", ["llama_canon", "gla5", "mamba2"])
def test_blocks_with_triton_canon_have_no_graph_breaks(family):
    import torch._dynamo

    extra = {"kernel_backend": "torch"} if family != "llama_canon" else {}
    block = _block(family, **extra).layers["0"]
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(torch.randn(2, 16, 128))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    ops = str(explanation.graphs[0].graph)
    assert "canon_titan.canon_swiglu" in ops and "canon_titan.canon_conv" in ops


def test_compiled_block_equals_eager_torch_backend():
    """Inductor compiles the block around the custom ops (fullgraph); forward and gradients equal
    the torch backend's eager run."""
    model = _block("llama_canon")
    reference = model_registry.model_spec("llama_canon", "debug", {"canon_backend": "torch"}).model.build()
    reference.load_state_dict(model.state_dict())
    block, ref_block = model.layers["1"], reference.layers["1"]
    x = torch.randn(2, 40, 128, generator=torch.Generator().manual_seed(3))
    results = []
    for run, params in ((torch.compile(block, fullgraph=True), block), (ref_block, ref_block)):
        inp = x.clone().requires_grad_()
        out = run(inp)
        out.square().sum().backward()
        results.append([out, inp.grad, *(p.grad for p in params.parameters())])
    # Inductor also reorders the block's float32 reductions (norms, matmul epilogues).
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
