"""The fla and mamba_ssm kernel backends (their Triton kernels, run by Triton's interpreter on this
CPU with the patches of triton_interpreter.py) against the torch kernels, which
test_linear_kernels.py checks against step-by-step recurrences; the custom ops that wrap them;
compile without graph breaks; whole models training; and the backend choice per machine.

Tolerance: float32, 1e-4 relative and absolute. The kernels differ only in summation order and in
fla's exp2-based decays; measured: at most 2e-5 on outputs, gradients and states of order 1-100.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import model_registry
import triton_interpreter
from canon_titan.kernels import gated_delta_rule, gla, ssd
from canon_titan.kernels.backends import INTERPRETED, KernelEnvironment, resolve_backend, triton_runs_here
from conftest import REPO
from test_linear_kernels import assert_match, outputs_and_grads

needs_triton = pytest.mark.skipif(not triton_runs_here(), reason="needs a GPU or TRITON_INTERPRET=1")
# scripts/test.sh installs both; a bare pytest without them skips their tests.
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention not installed")
needs_mamba = pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is None, reason="mamba-ssm not installed")
if INTERPRETED:
    triton_interpreter.apply()

TOL = dict(atol=1e-4, rtol=1e-4)
# batch, seq (not a multiple of any chunk), heads, key head dim, value head dim
SHAPES = [(2, 37, 3, 16, 32), (1, 100, 2, 32, 16)]


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def gla_inputs(batch, seq, heads, dk, dv, initial):
    g = torch.Generator().manual_seed(0)
    inputs = dict(q=_randn(g, batch, seq, heads, dk), k=_randn(g, batch, seq, heads, dk),
                  v=_randn(g, batch, seq, heads, dv), log_gate=F.logsigmoid(_randn(g, batch, seq, heads, dk) + 2) / 4)
    if initial:
        inputs["initial_state"] = _randn(g, batch, heads, dk, dv)
    return inputs


def gdn_inputs(batch, seq, heads, dk, dv, initial):
    g = torch.Generator().manual_seed(0)
    inputs = dict(q=F.normalize(_randn(g, batch, seq, heads, dk), dim=-1),
                  k=F.normalize(_randn(g, batch, seq, heads, dk), dim=-1), v=_randn(g, batch, seq, heads, dv),
                  log_decay=F.logsigmoid(_randn(g, batch, seq, heads) + 2), beta=torch.rand(batch, seq, heads, generator=g))
    if initial:
        inputs["initial_state"] = _randn(g, batch, heads, dk, dv)
    return inputs


def ssd_inputs(batch, seq, heads, head_dim, state, groups, initial):
    g = torch.Generator().manual_seed(0)
    inputs = dict(x=_randn(g, batch, seq, heads, head_dim), dt=F.softplus(_randn(g, batch, seq, heads) - 1),
                  A=-4 * torch.rand(heads, generator=g), B=_randn(g, batch, seq, groups, state),
                  C=_randn(g, batch, seq, groups, state), D=_randn(g, heads))
    if initial:
        inputs["initial_state"] = _randn(g, batch, heads, head_dim, state)
    return inputs


def _both(kernel, inputs, cuda_backend, **kw):
    got = outputs_and_grads(lambda i: kernel(**i, **kw, output_final_state=True, backend=cuda_backend), inputs)
    want = outputs_and_grads(lambda i: kernel(**i, **kw, output_final_state=True, backend="torch"), inputs)
    return got, want


@needs_triton
@needs_fla
@pytest.mark.parametrize("initial", [True, False], ids=["initial_state", "zero_state"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", ["gla", "gated_delta_rule"])
def test_fla_equals_torch(op, shape, initial):
    kernel, make = {"gla": (gla, gla_inputs), "gated_delta_rule": (gated_delta_rule, gdn_inputs)}[op]
    assert_match(*_both(kernel, make(*shape, initial), "fla"), **TOL)


@needs_triton
@needs_mamba
@pytest.mark.parametrize("heads, groups, chunk_size, initial", [(3, 1, 16, True), (4, 2, 32, False)])
def test_mamba_ssm_equals_torch(heads, groups, chunk_size, initial):
    """mamba_ssm's chunk size is the torch kernel's too; groups of B/C shared by blocks of heads."""
    inputs = ssd_inputs(2, 37, heads, 16, 8, groups, initial)
    assert_match(*_both(ssd, inputs, "mamba_ssm", chunk_size=chunk_size), **TOL)


@needs_triton
@pytest.mark.parametrize("op, make", [
    pytest.param("fla_chunk_gla", lambda: (*gla_inputs(1, 20, 2, 16, 16, True).values(), 0.25, True),
                 marks=needs_fla),
    pytest.param("fla_chunk_gated_delta_rule",
                 lambda: (*gdn_inputs(1, 20, 2, 16, 16, False).values(), None, 0.25, False), marks=needs_fla),
    pytest.param("mamba_chunk_scan", lambda: (*ssd_inputs(1, 20, 2, 16, 8, 1, True).values(), 16, True),
                 marks=needs_mamba),
])
def test_custom_op_registration(op, make):
    """torch.library's checks: schema, fake (meta) kernel against the real one, autograd
    registration, AOT dispatch with dynamic shapes."""
    args = tuple(t.requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in make())
    if op == "mamba_chunk_scan":  # (x, dt, A, B, C, D, initial_state, chunk_size, output_final_state)
        args = (*args[:5], args[5], args[6], *args[7:])
    torch.library.opcheck(getattr(torch.ops.canon_titan, op).default, args)


CUDA_BACKEND = {"gla5": "fla", "gdn2": "fla", "mamba2": "mamba_ssm"}
FAMILIES = [pytest.param("gla5", marks=needs_fla), pytest.param("gdn2", marks=needs_fla),
            pytest.param("mamba2", marks=needs_mamba)]


def _model(family, backend, **overrides):
    spec = model_registry.model_spec(family, "debug", {"kernel_backend": backend, **overrides})
    torch.manual_seed(0)
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
    explanation = torch._dynamo.explain(block)(torch.randn(2, 40, 128))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    op = {"gla5": "fla_chunk_gla", "gdn2": "fla_chunk_gated_delta_rule", "mamba2": "mamba_chunk_scan"}[family]
    assert f"canon_titan.{op}" in str(explanation.graphs[0].graph)


@needs_triton
@pytest.mark.parametrize("family", FAMILIES)
def test_training_steps_match_the_torch_kernels(family):
    """Two AdamW steps of the debug model (two layers) from the same weights and batch (the second
    runs on weights the first updated): losses and gradient norms agree to 1e-4 relative."""
    tokens = torch.randint(0, 2048, (2, 49), generator=torch.Generator().manual_seed(5))
    history = {}
    for backend in ("torch", CUDA_BACKEND[family]):
        model = _model(family, backend, n_layers=2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        history[backend] = []
        for _ in range(2):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            history[backend].append((loss.item(), norm.item()))
    for (loss, norm), (want_loss, want_norm) in zip(history[CUDA_BACKEND[family]], history["torch"]):
        assert loss == pytest.approx(want_loss, rel=1e-4) and norm == pytest.approx(want_norm, rel=1e-4)


# --- which backend runs where --------------------------------------------------------------------

NO_GPU = KernelEnvironment(cuda_capability=None, interpreter=False, triton="3.7.1", tilelang=False)
INTERPRETER = KernelEnvironment(cuda_capability=None, interpreter=True, triton="3.7.1", tilelang=False)
H100_TRITON_3_6 = KernelEnvironment(cuda_capability=(9, 0), interpreter=False, triton="3.6.0", tilelang=False)


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
    with pytest.raises(ValueError, match=r"Triton >= 3\.7\.1.*pip install tilelang.*kernel_backend = \"torch\""
                                         r".*this machine: sm_90 GPU, Triton 3\.6\.0"):
        resolve_backend("fla", op="gated_delta_rule", env=H100_TRITON_3_6)
    backend, why = resolve_backend("auto", op="gated_delta_rule", env=H100_TRITON_3_6)
    assert backend == "torch" and "fla issue #640" in why
    assert resolve_backend("auto", op="gla", env=H100_TRITON_3_6) == ("fla", None)
    for fine in (KernelEnvironment((9, 0), False, "3.7.1", False), KernelEnvironment((9, 0), False, "3.6.0", True),
                 KernelEnvironment((8, 0), False, "3.6.0", False)):
        assert resolve_backend("auto", op="gated_delta_rule", env=fine) == ("fla", None)


@needs_fla
@pytest.mark.parametrize("interpret", ["1", None])
def test_config_accepts_fla_without_a_gpu_only_with_the_interpreter(interpret):
    """Static validation (a recipe for the GPU cluster) accepts a forced kernel backend anywhere;
    validation for this machine needs a GPU or TRITON_INTERPRET=1, which is read at import, so each
    case runs in a fresh process."""
    if torch.cuda.is_available():
        pytest.skip("a GPU makes the backend valid either way")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = interpret

    def validate(*extra):
        return subprocess.run([sys.executable, "-m", "canon_titan.cli", "config", "validate", *extra,
                               str(REPO / "train_configs" / "gdn2_debug.toml"), "--model.kernel_backend", "fla"],
                              env=env, capture_output=True, text=True, timeout=300)

    proc = validate()
    if interpret:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 2
        assert "[model] kernel_backend: gated_delta_rule backend 'fla' runs Triton kernels" in proc.stderr
        assert validate("--static").returncode == 0
