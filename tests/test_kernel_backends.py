"""The fla and mamba_ssm kernel backends (their Triton kernels: on CUDA when a GPU is present, else
on CPU tensors in Triton's interpreter, which canon_titan.kernels.interpreter adapts them to)
against the torch kernels, which test_linear_kernels.py checks against step-by-step recurrences; the
custom ops that wrap them; compile without graph breaks; whole models training; and the backend
choice per machine (package versions, mamba-ssm without its compiled extension). Every comparison
asserts that the package's kernels ran (``kernel_paths.kernel_path``).

Tolerance, float32: on the CPU 1e-4 relative and absolute (the kernels differ only in summation
order and in fla's exp2-based decays; measured: at most 2e-5 on outputs, gradients and states of
order 1-100). On a GPU, fla's and mamba-ssm's ``tl.dot`` take float32 inputs as TF32 (10-bit
mantissa): 3e-3, an estimate until a GPU run measures it. Real shapes run on a GPU in bfloat16.
"""

import contextlib
import importlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import model_registry
from canon_titan.kernels import backends, gated_delta_rule, gla, ssd
from canon_titan.kernels.backends import KernelEnvironment, resolve_backend, triton_runs_here
from canon_titan.kernels.documents import Documents, document_boundaries
from conftest import REPO
from kernel_paths import DEVICE, ON_GPU, kernel_path
from test_linear_kernels import assert_match, document_positions, outputs_and_grads

needs_triton = pytest.mark.skipif(
    not triton_runs_here(), reason="needs a GPU or TRITON_INTERPRET=1"
)
# scripts/test.sh installs both; a bare pytest without them skips their tests.
needs_fla = pytest.mark.skipif(
    importlib.util.find_spec("fla") is None, reason="flash-linear-attention not installed"
)
needs_mamba = pytest.mark.skipif(
    importlib.util.find_spec("mamba_ssm") is None, reason="mamba-ssm not installed"
)

TOL = dict(atol=3e-3, rtol=3e-3) if ON_GPU else dict(atol=1e-4, rtol=1e-4)
OPS = {
    "gla": ("fla_chunk_gla", "fla_chunk_gla_backward"),
    "gated_delta_rule": ("fla_chunk_gated_delta_rule", "fla_chunk_gated_delta_rule_backward"),
    "ssd": ("mamba_chunk_scan", "mamba_chunk_scan_backward"),
}
# batch, seq (not a multiple of any chunk), heads, key head dim, value head dim
SHAPES = [(2, 37, 3, 16, 32), (1, 100, 2, 32, 16)]


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen).to(DEVICE)


def _rand(gen, *shape):
    return torch.rand(*shape, generator=gen).to(DEVICE)


def gla_inputs(batch, seq, heads, dk, dv, initial):
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        q=_randn(g, batch, seq, heads, dk),
        k=_randn(g, batch, seq, heads, dk),
        v=_randn(g, batch, seq, heads, dv),
        log_gate=F.logsigmoid(_randn(g, batch, seq, heads, dk) + 2) / 4,
    )
    if initial:
        inputs["initial_state"] = _randn(g, batch, heads, dk, dv)
    return inputs


def gdn_inputs(batch, seq, heads, dk, dv, initial):
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        q=F.normalize(_randn(g, batch, seq, heads, dk), dim=-1),
        k=F.normalize(_randn(g, batch, seq, heads, dk), dim=-1),
        v=_randn(g, batch, seq, heads, dv),
        log_decay=F.logsigmoid(_randn(g, batch, seq, heads) + 2),
        beta=_rand(g, batch, seq, heads),
    )
    if initial:
        inputs["initial_state"] = _randn(g, batch, heads, dk, dv)
    return inputs


def ssd_inputs(batch, seq, heads, head_dim, state, groups, initial):
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        x=_randn(g, batch, seq, heads, head_dim),
        dt=F.softplus(_randn(g, batch, seq, heads) - 1),
        A=-4 * _rand(g, heads),
        B=_randn(g, batch, seq, groups, state),
        C=_randn(g, batch, seq, groups, state),
        D=_randn(g, heads),
    )
    if initial:
        inputs["initial_state"] = _randn(g, batch, heads, head_dim, state)
    return inputs


KERNELS = {
    "gla": (gla, gla_inputs),
    "gated_delta_rule": (gated_delta_rule, gdn_inputs),
    "ssd": (ssd, ssd_inputs),
}
BACKEND = {"gla": "fla", "gated_delta_rule": "fla", "ssd": "mamba_ssm"}


def skip_where_known_bad(op: str) -> None:
    """A machine where the package refuses the op (``KNOWN_BAD``: fla's gated delta rule backward on
    Hopper with Triton < 3.7.1, the offline GPU kit's) cannot run its test."""
    problem = backends.backend_problem(BACKEND[op], op)
    if problem:
        pytest.skip(problem)


def _both(op, inputs, cuda_backend, **kw):
    kernel = KERNELS[op][0]
    with kernel_path(*OPS[op]):
        got = outputs_and_grads(
            lambda i: kernel(**i, **kw, output_final_state=True, backend=cuda_backend), inputs
        )
    want = outputs_and_grads(
        lambda i: kernel(**i, **kw, output_final_state=True, backend="torch"), inputs
    )
    return got, want


@needs_triton
@needs_fla
@pytest.mark.parametrize("initial", [True, False], ids=["initial_state", "zero_state"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", ["gla", "gated_delta_rule"])
def test_fla_equals_torch(op, shape, initial):
    skip_where_known_bad(op)
    assert_match(*_both(op, KERNELS[op][1](*shape, initial), "fla"), **TOL)


@needs_triton
@needs_mamba
@pytest.mark.parametrize(
    "heads, groups, chunk_size, initial", [(3, 1, 16, True), (4, 2, 32, False)]
)
def test_mamba_ssm_equals_torch(heads, groups, chunk_size, initial):
    """mamba_ssm's chunk size is the torch kernel's too; groups of B/C shared by blocks of heads."""
    inputs = ssd_inputs(2, 37, heads, 16, 8, groups, initial)
    assert_match(*_both("ssd", inputs, "mamba_ssm", chunk_size=chunk_size), **TOL)


@needs_triton
@needs_fla
def test_a_fallback_to_torch_fails_the_comparison(monkeypatch):
    """If the fla backend ran the torch kernel instead (here forced), the comparison would pass on
    its own; the kernel-path check is what fails it."""
    monkeypatch.setattr(
        importlib.import_module("canon_titan.kernels.gla"), "runs_cuda_kernel", lambda *args: False
    )
    with pytest.raises(AssertionError, match="kernel path not taken: canon_titan::fla_chunk_gla"):
        _both("gla", gla_inputs(1, 20, 2, 16, 16, False), "fla")


def _relative_errors(got, want) -> dict:
    from test_linear_kernels import named

    return {
        name: ((g.float() - w).abs().max() / w.abs().max()).item()
        for (name, g), w in zip(named(got).items(), named(want).values())
    }


@pytest.mark.skipif(
    not ON_GPU, reason="real shapes on a GPU only (the interpreter would take hours)"
)
@pytest.mark.parametrize(
    "op, backend, shape, kw",
    [
        pytest.param("gla", "fla", (1, 4096, 16, 128, 256, False), {}, marks=needs_fla),
        pytest.param(
            "gated_delta_rule", "fla", (1, 4096, 16, 128, 256, False), {}, marks=needs_fla
        ),
        pytest.param(
            "ssd",
            "mamba_ssm",
            (1, 4096, 16, 256, 128, 1, False),
            {"chunk_size": 256},
            marks=needs_mamba,
        ),
    ],
    ids=["gla", "gated_delta_rule", "ssd"],
)
def test_real_shapes_in_bfloat16(op, backend, shape, kw):
    """The 1B models' shapes (T 4096; GLA5/GDN2 heads of 128 x 256, Mamba2 heads of 256 with state
    128) in bfloat16, against the torch kernel in float32 on the same inputs: outputs, final states
    and every gradient within 2% of their largest value."""
    skip_where_known_bad(op)
    inputs = {k: v.bfloat16() for k, v in KERNELS[op][1](*shape).items()}
    kernel = KERNELS[op][0]
    with kernel_path(*OPS[op]):
        got = outputs_and_grads(
            lambda i: kernel(**i, **kw, output_final_state=True, backend=backend), inputs
        )
    want = outputs_and_grads(
        lambda i: kernel(**i, **kw, output_final_state=True, backend="torch"),
        {k: v.float() for k, v in inputs.items()},
    )
    errors = _relative_errors(got, want)
    assert max(errors.values()) < 2e-2, errors


@needs_triton
@pytest.mark.parametrize(
    "op, make",
    [
        pytest.param(
            "fla_chunk_gla",
            lambda: (*gla_inputs(1, 20, 2, 16, 16, True).values(), 0.25, True),
            marks=needs_fla,
        ),
        pytest.param(
            "fla_chunk_gated_delta_rule",
            lambda: (*gdn_inputs(1, 20, 2, 16, 16, False).values(), None, 0.25, False),
            marks=needs_fla,
        ),
        pytest.param(
            "mamba_chunk_scan",
            lambda: (*ssd_inputs(1, 20, 2, 16, 8, 1, True).values(), 16, True),
            marks=needs_mamba,
        ),
        pytest.param(
            "fla_chunk_gla_documents",
            lambda: (*gla_inputs(1, 20, 2, 16, 16, False).values(), 0.25, True, *_flat_documents()),
            marks=needs_fla,
        ),
        pytest.param(
            "fla_chunk_gated_delta_rule_documents",
            lambda: (
                *gdn_inputs(1, 20, 2, 16, 16, False).values(),
                0.25,
                True,
                *_flat_documents()[:2],
            ),
            marks=needs_fla,
        ),
        pytest.param(
            "mamba_chunk_scan_documents",
            lambda: (
                *ssd_inputs(1, 20, 2, 16, 8, 1, False).values(),
                16,
                True,
                Documents(document_positions(((5, 15),))).seq_idx(),
            ),
            marks=needs_mamba,
        ),
    ],
)
def test_custom_op_registration(op, make):
    """torch.library's checks: schema, fake (meta) kernel against the real one, autograd
    registration, AOT dispatch with dynamic shapes."""
    plain = op.removesuffix("_documents")
    skip_where_known_bad(next(name for name, ops in OPS.items() if plain in ops))
    args = tuple(
        t.requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in make()
    )
    with kernel_path(op, f"{op}_backward"):
        torch.library.opcheck(getattr(torch.ops.canon_titan, op).default, args)


def _flat_documents(lengths=((5, 15),)):
    """cu_seqlens, chunk_indices and positions of one row of documents, on the device."""
    positions = document_positions(lengths)
    boundaries = (t.to(DEVICE) for t in document_boundaries(positions).values())
    return (*boundaries, positions.reshape(-1).to(DEVICE))


# --- packed documents ---------------------------------------------------------------------------

DOCUMENTS = ((5, 1, 40, 24), (70,))
"""A partial first chunk, one token, a document across fla's 64-token chunks; one document a row."""


def _documents_inputs(op):
    if op == "ssd":
        return ssd_inputs(2, 70, 3, 16, 8, 1, False), {"chunk_size": 16}
    return KERNELS[op][1](2, 70, 2, 16, 32, False), {}


@needs_triton
@pytest.mark.parametrize(
    "op",
    [
        pytest.param("gla", marks=needs_fla),
        pytest.param("gated_delta_rule", marks=needs_fla),
        pytest.param("ssd", marks=needs_mamba),
    ],
)
def test_packed_documents_on_the_triton_kernels_equal_torch(op):
    """fla's varlen kernels (the batch flattened, the loaders' boundaries) and mamba-ssm's
    ``seq_idx`` against the torch kernels with the same documents, which test_linear_kernels.py
    checks against each document run alone: outputs, final states, every gradient."""
    skip_where_known_bad(op)
    inputs, kw = _documents_inputs(op)
    positions = document_positions(DOCUMENTS)
    documents = Documents(
        positions.to(DEVICE), **{k: t.to(DEVICE) for k, t in document_boundaries(positions).items()}
    )
    kernel = KERNELS[op][0]
    with kernel_path(
        *(
            f"{name}_documents"
            if not name.endswith("_backward")
            else name.replace("_backward", "_documents_backward")
            for name in OPS[op]
        )
    ):
        got = outputs_and_grads(
            lambda i: kernel(
                **i, **kw, documents=documents, output_final_state=True, backend=BACKEND[op]
            ),
            inputs,
        )
    want = outputs_and_grads(
        lambda i: kernel(**i, **kw, documents=documents, output_final_state=True, backend="torch"),
        inputs,
    )
    assert_match(got, want, **TOL)


@needs_triton
@needs_fla
@needs_mamba
def test_the_document_kernels_never_wait_for_the_device(monkeypatch):
    """The bodies of the document ops (a dispatch mode cannot see inside a custom op) forward and
    backward, counted by ``HostSyncs``: the boundaries from the host through queued copies, every
    other input on the device (made before counting). None waits. Without the chunk count the host
    knows, fla's GLA state kernels would read it back from the device three times per layer and step
    (the forward, the backward's recomputation, the backward), which the count sees."""
    sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
    from canon_titan.tools.host_memory import pinned
    from host_syncs import HostSyncs

    modules = {
        name: importlib.import_module(f"canon_titan.kernels.{name}")
        for name in ("gla", "delta_rule", "ssd")
    }
    device = torch.device(DEVICE.type, 0)

    def flat(inputs):
        return [t.reshape(1, -1, *t.shape[2:]).to(device) for t in inputs.values()]

    lengths = ((5, 1, 14), (20,))
    gla_args, gdn_args = (
        flat(gla_inputs(2, 20, 1, 16, 16, False)),
        flat(gdn_inputs(2, 20, 1, 16, 16, False)),
    )
    ssd_args = [t.to(device) for t in ssd_inputs(2, 20, 1, 16, 8, 1, False).values()]
    positions = document_positions(lengths)
    # in pinned memory, as the loaders send them (tools/host_memory: a stand-in on a CPU run)
    batch = {
        k: pinned(v) for k, v in {"positions": positions, **document_boundaries(positions)}.items()
    }

    def gla_step(cu_seqlens, chunk_indices, positions):
        o, _, A = modules["gla"].gla_documents_forward(
            *gla_args, 0.25, False, cu_seqlens, chunk_indices, positions.reshape(-1)
        )
        modules["gla"].gla_documents_backward(
            torch.ones_like(o), None, *gla_args, A, 0.25, cu_seqlens, chunk_indices
        )

    def every_step(cu_seqlens, chunk_indices, positions):
        gla_step(cu_seqlens, chunk_indices, positions)
        o, _, g_cumsum, A = modules["delta_rule"].gated_delta_rule_documents_forward(
            *gdn_args, 0.25, False, cu_seqlens, chunk_indices
        )
        q, k, v, _, beta = gdn_args
        modules["delta_rule"].gated_delta_rule_documents_backward(
            torch.ones_like(o), None, q, k, v, g_cumsum, beta, A, 0.25, cu_seqlens, chunk_indices
        )
        seq_idx = Documents(positions).seq_idx()
        y, _ = modules["ssd"].ssd_documents_forward(*ssd_args, 16, False, seq_idx)
        modules["ssd"].ssd_documents_backward(torch.ones_like(y), None, *ssd_args, y, 16, seq_idx)

    def waits(step):
        with HostSyncs() as counter:
            counter.mark_host(batch)
            step(
                *(
                    batch[name].to(device, non_blocking=True)
                    for name in ("cu_seqlens", "chunk_indices", "positions")
                )
            )
        return [w.split(" (")[0] for w in counter.waits]

    assert waits(every_step) == []
    monkeypatch.setattr(
        modules["gla"], "_chunk_count_known", lambda *args: contextlib.nullcontext()
    )
    assert waits(gla_step) == [
        "aten._local_scalar_dense.default at fla/ops/common/chunk_h.py:335"
    ] * 2 + ["aten._local_scalar_dense.default at fla/ops/common/chunk_h.py:399"]


CUDA_BACKEND = {"gla5": "fla", "gdn2": "fla", "mamba2": "mamba_ssm"}
FAMILY_OP = {"gla5": "gla", "gdn2": "gated_delta_rule", "mamba2": "ssd"}
FAMILIES = [
    pytest.param("gla5", marks=needs_fla),
    pytest.param("gdn2", marks=needs_fla),
    pytest.param("mamba2", marks=needs_mamba),
]


def _model(family, backend, **overrides):
    spec = model_registry.model_spec(family, "debug", {"kernel_backend": backend, **overrides})
    torch.manual_seed(0)
    with DEVICE:
        model = spec.model.build()
    model.init_states()
    assert model.layers["0"].mixer.backend == backend
    return model


@needs_triton
@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_with_kernel_backends_compile_without_graph_breaks(family):
    import torch._dynamo

    block = _model(family, CUDA_BACKEND[family], canon_backend="triton").layers["0"]
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(torch.randn(2, 40, 128, device=DEVICE))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert f"canon_titan.{OPS[FAMILY_OP[family]][0]}" in str(explanation.graphs[0].graph)


@needs_triton
@pytest.mark.parametrize("family", FAMILIES)
def test_training_steps_match_the_torch_kernels(family):
    """Two AdamW steps of the debug model (one layer) from the same weights and batch (the second
    runs on weights the first updated): losses and gradient norms agree to the float32 tolerance."""
    skip_where_known_bad(FAMILY_OP[family])
    tokens = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    history = {}
    for backend in ("torch", CUDA_BACKEND[family]):
        model = _model(family, backend, n_layers=1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        history[backend] = []
        ops = OPS[FAMILY_OP[family]] if backend != "torch" else ()
        with kernel_path(*ops):
            for _ in range(2):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                history[backend].append((loss.item(), norm.item()))
    for (loss, norm), (want_loss, want_norm) in zip(
        history[CUDA_BACKEND[family]], history["torch"]
    ):
        assert loss == pytest.approx(want_loss, rel=TOL["rtol"]) and norm == pytest.approx(
            want_norm, rel=TOL["rtol"]
        )


MODEL_DOCUMENTS = ((5, 1, 14), (20,))


@needs_triton
@pytest.mark.parametrize("canon_backend", ["torch", "triton"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_documents_equal_each_document_alone_on_the_triton_kernels(family, canon_backend):
    """test_linear_models.py's check with the packed batch on the Triton kernels (the loaders'
    boundaries, the document ops; one layer, float32, to 1e-4 of each tensor's largest entry), each
    document alone on the torch kernels (the same weights): the interpreter runs one forward and
    backward."""
    from test_linear_models import assert_packed_equals_alone
    from test_linear_models import document_positions as positions_of

    skip_where_known_bad(FAMILY_OP[family])
    model = _model(family, CUDA_BACKEND[family], n_layers=1, canon_backend=canon_backend)
    reference = _model(family, "torch", n_layers=1, canon_backend="torch")
    tokens = torch.randint(0, 2048, (2, 20), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    boundaries = {
        k: t.to(DEVICE) for k, t in document_boundaries(positions_of(MODEL_DOCUMENTS)).items()
    }
    with kernel_path(
        *(
            f"{name}_documents"
            if not name.endswith("_backward")
            else name.replace("_backward", "_documents_backward")
            for name in OPS[FAMILY_OP[family]]
        )
    ):
        assert_packed_equals_alone(model, tokens, MODEL_DOCUMENTS, 1e-4, reference, **boundaries)


# --- which backend runs where --------------------------------------------------------------------

NO_GPU = KernelEnvironment(cuda_capability=None, interpreter=False, triton="3.7.1", tilelang=False)
INTERPRETER = KernelEnvironment(
    cuda_capability=None, interpreter=True, triton="3.7.1", tilelang=False
)
H100_TRITON_3_6 = KernelEnvironment(
    cuda_capability=(9, 0), interpreter=False, triton="3.6.0", tilelang=False
)


@pytest.mark.parametrize("op", ["gla", "gated_delta_rule", "ssd"])
def test_auto_without_a_gpu_is_torch_even_with_the_interpreter(op):
    assert resolve_backend("auto", op=op, env=NO_GPU) == ("torch", "no GPU")
    assert resolve_backend("auto", op=op, env=INTERPRETER) == ("torch", "no GPU")
    assert resolve_backend("torch", op=op, env=H100_TRITON_3_6) == ("torch", None)


@needs_fla
def test_forced_backend_needs_a_gpu_or_the_interpreter():
    with pytest.raises(ValueError, match="need a CUDA GPU; without one, set TRITON_INTERPRET=1"):
        resolve_backend("fla", op="gla", env=NO_GPU)
    assert resolve_backend("fla", op="gla", env=INTERPRETER) == ("fla", None)


@needs_fla
def test_known_bad_hopper_and_triton_is_refused_and_auto_falls_back():
    """fla 0.6.0 refuses chunk_gated_delta_rule's backward on Hopper with Triton in [3.4, 3.7.1)
    inside step 1; caught from the environment alone. GLA has no such check in fla 0.6.0."""
    with pytest.raises(
        ValueError,
        match=r"Triton >= 3\.7\.1.*pip install tilelang.*kernel_backend = \"torch\""
        r".*this machine: sm_90 GPU, Triton 3\.6\.0",
    ):
        resolve_backend("fla", op="gated_delta_rule", env=H100_TRITON_3_6)
    backend, why = resolve_backend("auto", op="gated_delta_rule", env=H100_TRITON_3_6)
    assert backend == "torch" and "fla issue #640" in why
    assert resolve_backend("auto", op="gla", env=H100_TRITON_3_6) == ("fla", None)
    for fine in (
        KernelEnvironment((9, 0), False, "3.7.1", False),
        KernelEnvironment((9, 0), False, "3.6.0", True),
        KernelEnvironment((8, 0), False, "3.6.0", False),
    ):
        assert resolve_backend("auto", op="gated_delta_rule", env=fine) == ("fla", None)


@pytest.mark.parametrize(
    "op, backend, package, tested",
    [
        pytest.param("gla", "fla", "flash-linear-attention", "0.6.0", marks=needs_fla),
        pytest.param("ssd", "mamba_ssm", "mamba-ssm", "2.3.2.post1", marks=needs_mamba),
    ],
)
def test_an_untested_package_version_is_skipped_by_auto_and_refused_when_forced(
    monkeypatch, op, backend, package, tested
):
    """The wrappers call the packages' internal halves: another version may fail inside step 1 or
    compute wrong gradients."""
    h100 = KernelEnvironment((9, 0), False, "3.7.1", False)
    assert resolve_backend("auto", op=op, env=h100) == (
        backend,
        None,
    )  # the installed, tested version
    monkeypatch.setattr(backends, "installed_version", lambda _: "9.9.9")
    chosen, why = resolve_backend("auto", op=op, env=h100)
    assert (
        chosen == "torch"
        and f"{package}, tested with version {tested} only; this machine has 9.9.9" in why
    )
    with pytest.raises(
        ValueError,
        match=rf"{op} backend '{backend}': .*tested with version {tested} only; this "
        rf"machine has 9\.9\.9 .*install {package}=={tested}, or use 'torch'",
    ):
        resolve_backend(backend, op=op, env=h100)


@needs_fla
@needs_mamba
@pytest.mark.parametrize("interpret", ["1", None])
def test_config_accepts_forced_backends_without_a_gpu_only_with_the_interpreter(
    interpret, tmp_path
):
    """Static validation (a recipe for the GPU cluster) accepts a forced kernel backend anywhere;
    validation for this machine needs a GPU or TRITON_INTERPRET=1, which is read at import, so each
    case runs in a fresh process. There the product code imports mamba-ssm's Triton SSD by itself
    (this install has no compiled extension, which the package's ``__init__`` imports)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU makes the backend valid either way")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = interpret
    configs = []
    for family, backend in (("gdn2", "fla"), ("mamba2", "mamba_ssm")):
        text = (REPO / "train_configs" / f"{family}_debug.toml").read_text()
        configs.append(tmp_path / f"{family}.toml")
        configs[-1].write_text(
            text.replace('flavor = "debug"\n', f'flavor = "debug"\nkernel_backend = "{backend}"\n')
        )

    def validate(*extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "canon_titan.cli",
                "config",
                "validate",
                *extra,
                *map(str, configs),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    proc = validate()
    if interpret:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 2
        assert (
            "[model] kernel_backend: gated_delta_rule backend 'fla' runs Triton kernels"
            in proc.stderr
        )
        assert "[model] kernel_backend: ssd backend 'mamba_ssm' runs Triton kernels" in proc.stderr
        assert validate("--static").returncode == 0
