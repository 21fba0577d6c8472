"""Chunked linear-attention kernels against step-by-step recurrences (float64) and fla's naive
ops."""

import pytest
import torch
import torch.nn.functional as F

from canon_titan.kernels import gated_delta_rule, gla, resolve_backend, ssd
from canon_titan.kernels.documents import (
    FLA_CHUNK,
    Documents,
    document_boundaries,
    one_document_a_row,
)

B, H, K, V = 2, 3, 8, 6
STATE = 5  # SSD state size N
CHUNKS = (16, 24, 32, 64)  # 24: GLA's sub-chunks of 16 do not divide it
LENGTHS = (1, 37, 100)
F64 = dict(atol=1e-11, rtol=1e-10)  # observed: 1.1e-13 absolute


# --- step-by-step references (loops over t); argument names follow the kernels ---------------


def recurrent_gla(q, k, v, log_gate, initial_state):
    state, outs = initial_state, []
    for t in range(q.shape[1]):
        state = log_gate[:, t].exp().unsqueeze(-1) * state + k[:, t].unsqueeze(-1) * v[
            :, t
        ].unsqueeze(-2)
        outs.append(q.shape[-1] ** -0.5 * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, 1), state


def recurrent_gated_delta_rule(q, k, v, log_decay, beta, initial_state):
    state, outs = initial_state, []
    for t in range(q.shape[1]):
        state = log_decay[:, t].exp()[..., None, None] * state
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state))
        state = state + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(q.shape[-1] ** -0.5 * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, 1), state


def recurrent_ssd(x, dt, A, B, C, initial_state, D=None):
    heads_per_group = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(heads_per_group, 2), C.repeat_interleave(heads_per_group, 2)
    state, outs = initial_state, []
    for t in range(x.shape[1]):
        decay = (dt[:, t] * A).exp()[..., None, None]
        state = decay * state + (dt[:, t].unsqueeze(-1) * x[:, t]).unsqueeze(-1) * B[
            :, t
        ].unsqueeze(-2)
        y = torch.einsum("bhpn,bhn->bhp", state, C[:, t])
        outs.append(y if D is None else y + D.unsqueeze(-1) * x[:, t])
    return torch.stack(outs, 1), state


# --- inputs (float64) -------------------------------------------------------------------------


def _randn(seed):
    gen = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)


def gla_inputs(T, seed=0):
    r = _randn(seed)
    return dict(
        q=r(B, T, H, K),
        k=r(B, T, H, K),
        v=r(B, T, H, V),
        log_gate=F.logsigmoid(2 * r(B, T, H, K) + 2),
        initial_state=r(B, H, K, V),
    )


def gdn_inputs(T, seed=0):
    r = _randn(seed)
    return dict(
        q=F.normalize(r(B, T, H, K), dim=-1),
        k=F.normalize(r(B, T, H, K), dim=-1),
        v=r(B, T, H, V),
        log_decay=F.logsigmoid(r(B, T, H) + 2),
        beta=2 * torch.sigmoid(r(B, T, H)),
        initial_state=r(B, H, K, V),
    )


def ssd_inputs(T, seed=0, heads=H, groups=1):
    r = _randn(seed)
    return dict(
        x=r(B, T, heads, V),
        dt=F.softplus(r(B, T, heads) - 1),
        A=-4 * torch.sigmoid(r(heads)),
        B=r(B, T, groups, STATE),
        C=r(B, T, groups, STATE),
        D=r(heads),
        initial_state=r(B, heads, V, STATE),
    )


OPS = {  # kernel, its step-by-step reference, inputs
    "gla": (gla, recurrent_gla, gla_inputs),
    "gated_delta_rule": (gated_delta_rule, recurrent_gated_delta_rule, gdn_inputs),
    "ssd": (ssd, recurrent_ssd, ssd_inputs),
}


def outputs_and_grads(fn, inputs):
    """Output, final state and the gradients of a fixed random functional of both."""
    leaves = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}
    out, state = fn(leaves)
    gen = torch.Generator().manual_seed(1)
    # Drawn in one dtype: randn's stream depends on it.
    loss = (out * torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out)).sum() + (
        state * torch.randn(state.shape, generator=gen, dtype=torch.float64).to(state)
    ).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return out.detach(), state.detach(), dict(zip(leaves, grads))


def named(result):
    out, state, grads = result
    return {"output": out, "final state": state, **{f"d{name}": g for name, g in grads.items()}}


def assert_match(got, want, **tol):
    got = named(got)
    for name, expected in named(want).items():
        torch.testing.assert_close(got[name], expected, **tol, msg=lambda m, n=name: f"{n}: {m}")


# --- chunked kernels == recurrence ------------------------------------------------------------


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("op", OPS)
def test_chunked_matches_recurrence(op, T):
    kernel, recurrence, make = OPS[op]
    inputs = make(T)
    want = outputs_and_grads(lambda i: recurrence(**i), inputs)
    for chunk_size in CHUNKS:
        got = outputs_and_grads(
            lambda i: kernel(**i, chunk_size=chunk_size, output_final_state=True), inputs
        )
        assert_match(got, want, **F64)


def test_ssd_heads_share_groups_in_blocks():
    """Head h reads group h // (H // G), as in mamba_ssm; and D is optional."""
    inputs = ssd_inputs(37, heads=4, groups=2)
    inputs.pop("D")
    want = outputs_and_grads(lambda i: recurrent_ssd(**i), inputs)
    got = outputs_and_grads(lambda i: ssd(**i, chunk_size=16, output_final_state=True), inputs)
    assert_match(got, want, **F64)


@pytest.mark.parametrize("op", OPS)
def test_without_initial_or_final_state(op):
    kernel, recurrence, make = OPS[op]
    inputs = make(37)
    h0 = inputs.pop("initial_state")
    out, state = kernel(**inputs, chunk_size=16)
    assert state is None
    torch.testing.assert_close(
        out, recurrence(**inputs, initial_state=torch.zeros_like(h0))[0], **F64
    )


@pytest.mark.parametrize("op", OPS)
def test_float32_strong_decay_stays_finite_and_exact(op):
    """Log decays of about -30 per step sum to about -1000 over a 64-token chunk: exp(-cumsum), the
    textbook factorisation, overflows float32 beyond 88. The kernels only exponentiate log decays
    that are <= 0."""
    kernel, recurrence, make = OPS[op]
    inputs = make(100)
    gate = {"gla": "log_gate", "gated_delta_rule": "log_decay", "ssd": "dt"}[op]
    strong = torch.rand(inputs[gate].shape, generator=torch.Generator().manual_seed(2)) < 0.5
    # SSD's log decay is dt * A with A in (-4, 0).
    inputs[gate] = inputs[gate].masked_fill(strong, 15.0 if op == "ssd" else -30.0)
    want = outputs_and_grads(lambda i: recurrence(**i), inputs)
    got = outputs_and_grads(
        lambda i: kernel(**i, output_final_state=True),
        {name: t.float() for name, t in inputs.items()},
    )
    # float32 cumulative sums of ~-1000 leave a few 1e-5 relative error in exp(b_i - b_j) (fla's
    # chunked kernels share this), hence the tolerance relative to each tensor's largest entry.
    for name, expected in named(want).items():
        error = (named(got)[name].double() - expected).abs().max()
        assert error <= 1e-4 * expected.abs().max(), name


@pytest.mark.parametrize("op", OPS)
def test_bfloat16_in_bfloat16_out(op):
    kernel, recurrence, make = OPS[op]
    inputs = {name: t.bfloat16() for name, t in make(37).items()}
    out, state = kernel(**inputs, output_final_state=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    want, _ = recurrence(**{name: t.double() for name, t in inputs.items()})
    torch.testing.assert_close(out.double(), want, atol=0.05, rtol=0.05)


# --- packed documents -----------------------------------------------------------------------------

DOCUMENTS = ((5, 1, 40, 30, 24), (100,))
"""Documents of each row (100 tokens): shorter than a chunk, one token, across chunk boundaries; one
document a row."""
PER_TOKEN = {
    "gla": ("q", "k", "v", "log_gate"),
    "gated_delta_rule": ("q", "k", "v", "log_decay", "beta"),
    "ssd": ("x", "dt", "B", "C"),
}


def document_positions(lengths=DOCUMENTS) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def each_alone(op, recurrence, lengths=DOCUMENTS):
    """The step-by-step recurrence on each document alone (a zero state at its start), put back in
    place: the output, each row's last document's final state."""

    def run(i):
        outs, states = [], []
        for b, row in enumerate(lengths):
            start, pieces = 0, []
            for n in row:
                doc = {
                    name: t[b : b + 1, start : start + n] if name in PER_TOKEN[op] else t
                    for name, t in i.items()
                }
                out, state = recurrence(**doc, initial_state=_zero_state(op, i))
                pieces.append(out)
                start += n
            outs.append(torch.cat(pieces, 1))
            states.append(state)
        return torch.cat(outs), torch.cat(states)

    return run


def _zero_state(op, i):
    if op == "ssd":
        return i["x"].new_zeros(1, i["x"].shape[2], i["x"].shape[3], i["B"].shape[3])
    return i["q"].new_zeros(1, i["q"].shape[2], i["q"].shape[3], i["v"].shape[3])


@pytest.mark.parametrize("op", OPS)
def test_packed_documents_equal_each_document_alone(op):
    """With ``documents`` every packed document starts from a zero state: outputs, each row's final
    state and every input's gradient equal the recurrence run on each document alone, for chunks
    that documents start inside of, end inside of and span."""
    kernel, recurrence, make = OPS[op]
    inputs = make(100)
    inputs.pop("initial_state")
    want = outputs_and_grads(each_alone(op, recurrence), inputs)
    documents = Documents(document_positions())
    for chunk_size in CHUNKS:
        got = outputs_and_grads(
            lambda i: kernel(
                **i, chunk_size=chunk_size, documents=documents, output_final_state=True
            ),
            inputs,
        )
        assert_match(got, want, **F64)


@pytest.mark.parametrize("op", OPS)
def test_documents_take_no_initial_state(op):
    kernel, _, make = OPS[op]
    with pytest.raises(ValueError, match="each start from a zero state; no initial_state"):
        kernel(**make(20), documents=Documents(document_positions(((20,), (20,)))))


def test_document_boundaries_are_fla_s():
    """The loaders' boundaries (``document_boundaries``) against fla's own: its ``cu_seqlens`` of
    the flattened batch (from the documents' lengths) and its ``prepare_chunk_indices``; a document
    running over a row's end is cut there (every row starts one)."""
    pytest.importorskip("fla")
    from fla.ops.utils.index import prepare_chunk_indices, prepare_cu_seqlens_from_lens

    lengths = ((5, 1, 130, 64), (200,), (63, 1, 65, 71))
    got = document_boundaries(document_positions(lengths))
    cu_seqlens = prepare_cu_seqlens_from_lens(torch.tensor([n for row in lengths for n in row]))
    assert got["cu_seqlens"].dtype == got["chunk_indices"].dtype == torch.int32
    assert torch.equal(got["cu_seqlens"], cu_seqlens)
    assert torch.equal(got["chunk_indices"], prepare_chunk_indices(cu_seqlens, FLA_CHUNK))
    running_on = torch.stack(
        [torch.arange(100), torch.arange(37, 137)]
    )  # row 1 starts inside a document
    assert document_boundaries(running_on)["cu_seqlens"].tolist() == [0, 100, 200]
    documents = Documents(document_positions(lengths))
    assert all(torch.equal(a, b) for a, b in zip(documents.fla_layout(), got.values()))
    one_each = document_boundaries(torch.arange(130).expand(3, -1))
    made = one_document_a_row(3, 130)
    assert all(torch.equal(a, b) for a, b in zip(made.values(), one_each.values()))


# --- fla's pure-torch references --------------------------------------------------------------

F32 = dict(atol=1e-4, rtol=1e-4)  # observed: 5.7e-5 absolute on values up to ~40


def test_gla_matches_fla_naive():
    pytest.importorskip("fla")
    from fla.ops.gla.naive import naive_recurrent_gla

    inputs = {name: t.float() for name, t in gla_inputs(100).items()}
    # naive_recurrent_gla has no scale argument: it always uses K**-0.5, our default.
    want = outputs_and_grads(
        lambda i: naive_recurrent_gla(
            i["q"], i["k"], i["v"], i["log_gate"], i["initial_state"], output_final_state=True
        ),
        inputs,
    )
    got = outputs_and_grads(lambda i: gla(**i, output_final_state=True), inputs)
    assert_match(got, want, **F32)


def test_gated_delta_rule_matches_fla_naive():
    pytest.importorskip("fla")
    from fla.ops.gated_delta_rule.naive import (
        naive_chunk_gated_delta_rule,
        naive_recurrent_gated_delta_rule,
    )

    inputs = {name: t.float() for name, t in gdn_inputs(100).items()}
    got = outputs_and_grads(lambda i: gated_delta_rule(**i, output_final_state=True), inputs)
    # The recurrent reference takes (q, k, v, beta, g), the chunked one (q, k, v, g, beta).
    recurrent = outputs_and_grads(
        lambda i: naive_recurrent_gated_delta_rule(
            i["q"],
            i["k"],
            i["v"],
            i["beta"],
            i["log_decay"],
            initial_state=i["initial_state"],
            output_final_state=True,
        ),
        inputs,
    )
    chunked = outputs_and_grads(
        lambda i: naive_chunk_gated_delta_rule(
            i["q"],
            i["k"],
            i["v"],
            i["log_decay"],
            i["beta"],
            chunk_size=32,
            initial_state=i["initial_state"],
            output_final_state=True,
        ),
        inputs,
    )
    assert_match(got, recurrent, **F32)
    assert_match(got, chunked, **F32)


def test_ssd_matches_fla_naive_simple_gla():
    """fla 0.6 ships no standalone SSD op (its Mamba2 layer inlines one in ``torch_forward``); SSD
    is simple GLA (a scalar decay per head) with q = C, k = B, v = dt x, g = dt A, scale 1 and the
    state transposed, so fla's naive simple-GLA recurrence is the reference."""
    pytest.importorskip("fla")
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    inputs = {name: t.float() for name, t in ssd_inputs(100).items()}

    def via_simple_gla(i):
        heads = i["x"].shape[2] // i["B"].shape[2]
        o, state = naive_recurrent_simple_gla(
            i["C"].repeat_interleave(heads, 2),
            i["B"].repeat_interleave(heads, 2),
            i["x"] * i["dt"].unsqueeze(-1),
            i["dt"] * i["A"],
            scale=1.0,
            initial_state=i["initial_state"].transpose(-1, -2),
            output_final_state=True,
        )
        return o + i["D"].unsqueeze(-1) * i["x"], state.transpose(-1, -2)

    want = outputs_and_grads(via_simple_gla, inputs)
    got = outputs_and_grads(lambda i: ssd(**i, output_final_state=True), inputs)
    assert_match(got, want, **F32)


def test_bad_backend_names_the_allowed_ones():
    with pytest.raises(
        ValueError, match=r"must be one of 'auto', 'torch', 'fla' for gla, got 'triton'"
    ):
        resolve_backend("triton", op="gla")
    with pytest.raises(
        ValueError, match=r"must be one of 'auto', 'torch', 'mamba_ssm' for ssd, got 'fla'"
    ):
        resolve_backend("fla", op="ssd")
