"""The Triton Canon kernels against the torch backend: outputs and every gradient, the custom-op
registration, and compile without graph breaks. On a machine with a GPU they run on CUDA tensors
(plus real shapes in bfloat16); without one, on CPU tensors in Triton's interpreter. Every
comparison asserts that the kernels ran (``kernel_paths.kernel_path``): a backend that fell back to
torch fails it. The torch backend itself is checked against hand loops in test_canon.py.

The interpreter's block covers up to 128 rows x 512 channels and the weight-gradient chunk is 128
rows; on a GPU the blocks are 16-32 rows x 32-256 channels. The shapes below cover partial blocks in
both dimensions, several chunks, and T shorter than K.
"""

import pytest
import torch

import model_registry
from canon_titan.kernels import canon
from canon_titan.kernels.backends import triton_runs_here
from canon_titan.kernels.canon import canon_conv, canon_swiglu
from kernel_paths import DEVICE, ON_GPU, kernel_path, randn

pytestmark = pytest.mark.skipif(not triton_runs_here(), reason="needs a GPU or TRITON_INTERPRET=1")

# float32 on either device (the kernels have no tl.dot, so no TF32): only the summation order
# differs (tiles, per-chunk partial sums of the weight gradient).
TOL = dict(rtol=1e-5, atol=1e-4)
CONV_OPS = ("canon_conv", "canon_conv_backward")
SCALED_CONV_OPS = (
    "canon_conv",
    "canon_conv_weight_grads",
)  # the input's gradient by torch ops (Inductor's)
SWIGLU_OPS = ("canon_swiglu", "canon_swiglu_backward")

# batch, seq, channels, kernel, residual, activation, bias
CASES = [
    (2, 37, 300, 4, True, False, False),  # Canon-A/B/C as LlamaCanon uses them
    (
        1,
        300,
        5,
        3,
        False,
        True,
        True,
    ),  # Mamba2's short convolution (no residual, SiLU, bias); 3 chunks
    (2, 130, 600, 2, True, True, True),  # everything on
    (1, 3, 40, 4, True, False, True),  # fewer tokens than taps
    (2, 200, 257, 4, False, True, False),  # GLA5/GDN2 short convolutions; one channel past a block
]


def _positions(g, batch, seq):
    """Document positions: documents of random lengths packed into each row."""
    starts = torch.rand(batch, seq, generator=g) < 0.2
    starts[:, 0] = True
    index = torch.arange(seq).expand(batch, seq)
    last_start = torch.where(starts, index, 0).cummax(1).values
    return (index - last_start).to(DEVICE)


def _run(fn, tensors, dy, backend):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    out = fn(*leaves, backend=backend)
    grads = torch.autograd.grad(out, [t for t in leaves if t is not None], dy)
    return [out, *grads]


def assert_backends_agree(fn, tensors, ops, seed=1):
    gen = torch.Generator().manual_seed(seed)
    dy = randn(gen, *tensors[0].shape)
    with kernel_path(*ops):
        results = _run(fn, tensors, dy, "triton")
    for got, want in zip(results, _run(fn, tensors, dy, "torch")):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("batch, seq, channels, kernel, residual, activation, bias", CASES)
def test_canon_conv_triton_equals_torch(batch, seq, channels, kernel, residual, activation, bias):
    gen = torch.Generator().manual_seed(0)
    x, w = randn(gen, batch, seq, channels), randn(gen, channels, kernel)
    b = randn(gen, channels) if bias else None

    def fn(x, w, b, backend):
        return canon_conv(x, w, b, residual=residual, activation=activation, backend=backend)

    assert_backends_agree(fn, [x, w, b], CONV_OPS)


@pytest.mark.parametrize(
    "batch, seq, channels, kernel, residual, activation, bias", [CASES[0], CASES[2]]
)
def test_fused_rmsnorm_input(batch, seq, channels, kernel, residual, activation, bias):
    """Canon-A/B/C take the RMSNorm's inverse RMS (per token) and weight (per channel) and scale
    their input inside the kernel; gradients reach x, both scales, the weight and the bias."""
    gen = torch.Generator().manual_seed(0)
    x, w = randn(gen, batch, seq, channels), randn(gen, channels, kernel)
    b = randn(gen, channels) if bias else None
    row_scale, col_scale = (
        (torch.rand(batch, seq, generator=gen) + 0.5).to(DEVICE),
        randn(gen, channels),
    )

    def fn(x, w, b, row_scale, col_scale, backend):
        return canon_conv(
            x,
            w,
            b,
            row_scale=row_scale,
            col_scale=col_scale,
            residual=residual,
            activation=activation,
            backend=backend,
        )

    assert_backends_agree(
        fn, [x, w, b, row_scale, col_scale], CONV_OPS if activation else SCALED_CONV_OPS
    )


@pytest.mark.parametrize("batch, seq, channels, kernel, residual, activation, bias", CASES)
def test_canon_swiglu_triton_equals_torch(batch, seq, channels, kernel, residual, activation, bias):
    gen = torch.Generator().manual_seed(0)
    gate, up = randn(gen, batch, seq, channels), randn(gen, batch, seq, channels)
    w = randn(gen, 2 * channels, kernel)
    b = randn(gen, 2 * channels) if bias else None

    def fn(gate, up, w, b, backend):
        return canon_swiglu(
            gate, up, w, b, residual=residual, activation=activation, backend=backend
        )

    assert_backends_agree(fn, [gate, up, w, b], SWIGLU_OPS)


def test_long_chunks_give_the_same_gradients(monkeypatch):
    """Where a backward launch keeps enough programs its programs reduce the weight gradient over
    512 rows (here forced at a small shape: two chunks, the second partial), with the fused norm,
    SiLU and SwiGLU."""
    monkeypatch.setattr(canon, "MIN_PROGRAMS", 1)
    for blocks in (canon.BACKWARD_BLOCKS, canon.SWIGLU_BACKWARD_BLOCKS):
        assert canon._chunk_rows(1, 700, 24, blocks) == canon.LONG_CHUNK_T == 512
    gen = torch.Generator().manual_seed(0)
    x, u, w, b = randn(gen, 1, 700, 24), randn(gen, 1, 700, 24), randn(gen, 48, 4), randn(gen, 48)
    row_scale, col_scale = (torch.rand(1, 700, generator=gen) + 0.5).to(DEVICE), randn(gen, 24)

    def norm_conv(x, w, rs, cs, backend):
        return canon_conv(x, w, row_scale=rs, col_scale=cs, backend=backend)

    def silu_conv(x, w, b, backend):
        return canon_conv(x, w, b, residual=False, activation=True, backend=backend)

    def swiglu(g, u, w, backend):
        return canon_swiglu(g, u, w, backend=backend)

    assert_backends_agree(norm_conv, [x, w[:24], row_scale, col_scale], SCALED_CONV_OPS)
    assert_backends_agree(silu_conv, [x, w[:24], b[:24]], CONV_OPS)
    assert_backends_agree(swiglu, [x, u, w], SWIGLU_OPS)


@pytest.mark.skipif(ON_GPU, reason="the GPU runs these blocks in every test")
def test_the_gpus_blocks_walk_the_same(monkeypatch):
    """Under the interpreter the kernels walk each chunk as many runs of one group of rows side by
    side (its cost is per block op); a GPU walks one run per program, group after group with the
    next group's loads in flight, and tests a group's last document position. Those blocks here:
    several chunks and channel blocks (both partial), several groups a run, documents starting
    anywhere."""
    monkeypatch.setattr(canon, "CHUNK_T", 24)
    monkeypatch.setattr(
        canon,
        "_interpreter_blocks",
        lambda channels, chunk, unroll: {"BLOCK_C": 16, "CHUNK": chunk, "STREAMS": 1, "U": unroll},
    )
    gen = torch.Generator().manual_seed(0)
    x, u, w, b = randn(gen, 1, 40, 20), randn(gen, 1, 40, 20), randn(gen, 40, 4), randn(gen, 40)
    row_scale, col_scale = (torch.rand(1, 40, generator=gen) + 0.5).to(DEVICE), randn(gen, 20)
    documents = torch.cat([torch.arange(n) for n in (3, 25, 1, 11)])[None].to(
        DEVICE
    )  # some groups far from a start
    for positions in (None, documents):

        def norm_conv(x, w, rs, cs, backend):
            return canon_conv(
                x, w, row_scale=rs, col_scale=cs, positions=positions, backend=backend
            )

        def silu_conv(x, w, b, backend):
            return canon_conv(
                x, w, b, residual=False, activation=True, positions=positions, backend=backend
            )

        def swiglu(g, u, w, b, backend):
            return canon_swiglu(g, u, w, b, positions=positions, backend=backend)

        assert_backends_agree(norm_conv, [x, w[:20], row_scale, col_scale], SCALED_CONV_OPS)
        assert_backends_agree(silu_conv, [x, w[:20, :3], b[:20]], CONV_OPS)
        assert_backends_agree(swiglu, [x, u, w, b], SWIGLU_OPS)


def test_non_contiguous_inputs_and_weights():
    """A channel slice of a wider activation, a [B, C, T] buffer seen as [B, T, C], a weight with a
    row stride and a strided bias are read in place."""
    gen = torch.Generator().manual_seed(0)
    sliced = randn(gen, 2, 70, 400)[:, :, 50:350]
    transposed = randn(gen, 2, 300, 70).transpose(1, 2)
    weight, bias = randn(gen, 300, 6)[:, 1:5], randn(gen, 600)[::2]
    assert not any(t.is_contiguous() for t in (sliced, transposed, weight, bias))

    def conv(x, w, b, backend):
        return canon_conv(x, w, b, residual=True, activation=True, backend=backend)

    def swiglu(g, u, w, backend):
        return canon_swiglu(g, u, w, None, residual=True, activation=False, backend=backend)

    for x in (sliced, transposed):
        assert_backends_agree(conv, [x, weight, bias], CONV_OPS)
    assert_backends_agree(swiglu, [sliced, transposed, randn(gen, 600, 6)[:, 1:5]], SWIGLU_OPS)


def test_a_fallback_to_torch_fails_the_comparison(monkeypatch):
    """If the triton backend ran torch instead (here forced), the comparison with torch would pass
    on its own; the kernel-path check is what fails it."""
    gen = torch.Generator().manual_seed(0)
    x, w = randn(gen, 1, 20, 24), randn(gen, 24, 4)

    def fn(x, w, backend):
        return canon_conv(x, w, residual=True, backend=backend)

    monkeypatch.setattr(canon, "_use_triton", lambda *args: False)
    with pytest.raises(
        AssertionError, match=r"kernel path not taken: canon_titan::canon_conv, canon_conv_backward"
    ):
        assert_backends_agree(fn, [x, w], CONV_OPS)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("conv", [True, False], ids=["canon_conv", "canon_swiglu"])
def test_bfloat16_stays_close_to_float32(conv):
    """bf16 inputs, float32 accumulation, outputs and gradients rounded once: within 1% of the
    largest value of the float32 reference computed from the same (rounded) inputs."""
    gen = torch.Generator().manual_seed(0)
    x, u, w = randn(gen, 2, 50, 96), randn(gen, 2, 50, 96), randn(gen, 192, 4) * 0.5
    if conv:
        inputs, fn, ops = (
            [x, w[:96]],
            lambda x, w, backend: canon_conv(x, w, activation=True, backend=backend),
            CONV_OPS,
        )
    else:
        inputs, fn, ops = (
            [x, u, w],
            lambda g, u, w, backend: canon_swiglu(g, u, w, backend=backend),
            SWIGLU_OPS,
        )
    inputs = [t.bfloat16() for t in inputs]
    dy = randn(gen, 2, 50, 96)
    with kernel_path(*ops):
        got = _run(fn, inputs, dy.bfloat16(), "triton")
    want = _run(fn, [t.float() for t in inputs], dy.bfloat16().float(), "torch")
    assert all(g.dtype == torch.bfloat16 for g in got)
    for g, e in zip(got, want):
        assert _relative_error(g, e) < 1e-2


@pytest.mark.skipif(
    not ON_GPU, reason="real shapes on a GPU only (the interpreter would take hours)"
)
@pytest.mark.parametrize(
    "batch, dim, hidden", [(8, 2048, 5632), (1, 4096, 14336)], ids=["1B", "8B"]
)
def test_real_shapes_in_bfloat16(batch, dim, hidden):
    """The models' shapes in bfloat16 (T 4096; LlamaCanon-1B at its recipes' batch: Canon-A/B/C with
    the fused norm, Canon-B on v, Canon-D with SwiGLU; and 8B's widths), against the float32 torch
    backend on the same inputs: within 1% of each tensor's largest value."""
    gen = torch.Generator().manual_seed(0)
    x, dy = (randn(gen, batch, 4096, dim, dtype=torch.bfloat16) for _ in range(2))
    g, u, dy2 = (randn(gen, batch, 4096, hidden, dtype=torch.bfloat16) for _ in range(3))
    w, w2 = (randn(gen, dim, 4) * 0.5).bfloat16(), (randn(gen, 2 * hidden, 4) * 0.5).bfloat16()
    row_scale, col_scale = (
        torch.rand(batch, 4096, device=DEVICE) + 0.5,
        randn(gen, dim, dtype=torch.bfloat16),
    )
    cases = [
        (
            SCALED_CONV_OPS,
            [x, w, row_scale, col_scale],
            dy,
            lambda x, w, rs, cs, backend: canon_conv(
                x, w, row_scale=rs, col_scale=cs, backend=backend
            ),
        ),
        (CONV_OPS, [x, w], dy, lambda x, w, backend: canon_conv(x, w, backend=backend)),
        (
            SWIGLU_OPS,
            [g, u, w2],
            dy2,
            lambda g, u, w, backend: canon_swiglu(g, u, w, backend=backend),
        ),
    ]
    for ops, inputs, grad, fn in cases:
        with kernel_path(*ops):
            got = _run(fn, inputs, grad, "triton")
        want = _run(fn, [t.float() for t in inputs], grad.float(), "torch")
        for g_, e in zip(got, want):
            assert _relative_error(g_, e) < 1e-2, ops


@pytest.mark.parametrize(
    "op, backward, args",
    [
        (
            "canon_conv",
            "canon_conv_backward",
            lambda g: (randn(g, 2, 20, 48), randn(g, 48, 4), randn(g, 48), None, None, True, True),
        ),
        (
            "canon_conv",
            "canon_conv_weight_grads",
            lambda g: (
                randn(g, 2, 20, 48),
                randn(g, 48, 2),
                None,
                torch.rand(2, 20, generator=g).to(DEVICE),
                randn(g, 48),
                True,
                False,
                _positions(g, 2, 20),
            ),
        ),
        (
            "canon_swiglu",
            "canon_swiglu_backward",
            lambda g: (
                randn(g, 2, 20, 24),
                randn(g, 2, 20, 24),
                randn(g, 48, 3),
                None,
                True,
                False,
                _positions(g, 2, 20),
            ),
        ),
    ],
)
def test_op_registration(op, backward, args):
    """torch.library's own checks of the ``triton_op`` registration a GPU runs too: schema, fake
    (the body, traced) against the real op, autograd registration, and AOT dispatch with dynamic
    shapes."""
    inputs = args(torch.Generator().manual_seed(0))
    inputs = tuple(
        t.requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in inputs
    )
    with kernel_path(op, backward):
        torch.library.opcheck(getattr(torch.ops.canon_titan, op).default, inputs)


def _block(family, **overrides):
    spec = model_registry.model_spec(family, "debug", {"canon_backend": "triton", **overrides})
    torch.manual_seed(0)
    with DEVICE:
        model = spec.model.build()
    model.init_states()
    return model


@pytest.mark.parametrize("family", ["llama_canon", "gla5", "mamba2"])
def test_blocks_with_triton_canon_have_no_graph_breaks(family):
    import torch._dynamo

    extra = {"kernel_backend": "torch"} if family != "llama_canon" else {}
    block = _block(family, **extra).layers["0"]
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(torch.randn(2, 16, 128, device=DEVICE))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    ops = str(explanation.graphs[0].graph)
    assert "canon_titan.canon_swiglu" in ops and "canon_titan.canon_conv" in ops


def test_compiled_block_equals_eager_torch_backend():
    """The block compiled around the Canon ops (fullgraph; AOT autograd's graphs, run eagerly:
    ``test_canon_compile.py`` holds Inductor's sm_90 code generation of the same block): forward and
    gradients equal the torch backend's eager run."""
    model = _block("llama_canon")
    with DEVICE:
        reference = model_registry.model_spec(
            "llama_canon", "debug", {"canon_backend": "torch"}
        ).model.build()
    reference.load_state_dict(model.state_dict())
    block, ref_block = model.layers["1"], reference.layers["1"]
    x = randn(torch.Generator().manual_seed(3), 2, 40, 128)
    results = []
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    for run, params in ((compiled, block), (ref_block, ref_block)):
        inp = x.clone().requires_grad_()
        out = run(inp)
        out.square().sum().backward()
        results.append([out, inp.grad, *(p.grad for p in params.parameters())])
    # float32 sums of a whole block's matmuls and norms: the kernels' own tolerance, 10 times.
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
