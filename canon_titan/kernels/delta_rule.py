"""Gated delta rule (GatedDeltaNet, GDN2), in fla's convention
(``naive_recurrent_gated_delta_rule``):

    S'  = exp(g_t) S_{t-1}
    u_t = beta_t (v_t - S'^T k_t)
    S_t = S' + k_t u_t^T                    i.e. S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} +
        beta_t k_t v_t^T
    o_t = scale * q_t S_t

q, k: [B, T, H, K]; v: [B, T, H, V]; g (log decay, <= 0) and beta: [B, T, H]; S: [B, H, K, V].
The caller L2-normalises q and k.

The torch kernel is the chunked WY form. With b the cumulative log decay from the chunk start and
S0 the state entering the chunk, the corrections of one chunk satisfy
    u_i + beta_i sum_{j<i} exp(b_i - b_j) (k_i . k_j) u_j = beta_i v_i - beta_i exp(b_i) k_i^T S0,
a unit lower-triangular system solved once for both right-hand sides (u = U - W S0); only the
[C, K] x [K, V] products that involve S0 stay in the loop over chunks.

Backends: ``torch`` (below) and ``fla``, fla 0.6.0's chunked Triton kernels
(``chunk_gated_delta_rule_fwd`` / ``_bwd``, the halves of its ``ChunkGatedDeltaRuleFunction``)
behind the custom ops ``canon_titan::fla_chunk_gated_delta_rule`` and its backward.
"""

from __future__ import annotations

import functools

import torch

from canon_titan.kernels.backends import (
    compute_dtype,
    decay_matrix,
    from_chunks,
    prepare_kernels,
    runs_cuda_kernel,
    to_chunks,
)
from canon_titan.kernels.documents import FLA_CHUNK, Documents, kept, separate


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    documents: Documents | None = None,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns o [B, T, H, V] in q's dtype and, if asked, the final state [B, H, K, V] (float32, or
    float64 for double inputs). ``scale`` defaults to K**-0.5. ``chunk_size`` is the torch kernel's
    block length; fla uses its default (64). ``documents`` as in ``gla``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if documents is not None and initial_state is not None:
        raise ValueError(
            "gated_delta_rule: packed documents each start from a zero state; no initial_state"
        )
    if runs_cuda_kernel(backend, q) and documents is not None:
        batch, seq_len = q.shape[:2]
        cu_seqlens, chunk_indices = documents.fla_layout()
        flat = [t.reshape(1, batch * seq_len, *t.shape[2:]) for t in (q, k, v, log_decay, beta)]
        o, final_state, *_ = torch.ops.canon_titan.fla_chunk_gated_delta_rule_documents(
            *flat, scale, output_final_state, cu_seqlens, chunk_indices
        )
        o = o.view(batch, seq_len, *o.shape[2:])
        return o, final_state.index_select(0, documents.row_ends()) if output_final_state else None
    if runs_cuda_kernel(backend, q):
        h0 = None if initial_state is None else initial_state.float()
        o, final_state, *_ = torch.ops.canon_titan.fla_chunk_gated_delta_rule(
            q, k, v, log_decay, beta, h0, scale, output_final_state
        )
        return o, final_state if output_final_state else None
    o, final_state = _gated_delta_rule_torch(
        q, k, v, log_decay, beta, scale, chunk_size, initial_state, documents
    )
    return o, final_state if output_final_state else None


FLA_CHUNK_SIZE = FLA_CHUNK
"""fla's default block length for the gated delta rule (its varlen chunk indices' too)."""


@functools.cache
def _fla_halves():
    """fla's forward and backward halves of ``ChunkGatedDeltaRuleFunction``, each under fla's
    ``input_guard`` (its kernels assume contiguous [B, T, H, K] and launch on the current device),
    guarded once (see
    ``gla._fla_halves``)."""
    prepare_kernels("fla")
    from fla.ops.gated_delta_rule.chunk import (
        chunk_gated_delta_rule_bwd,
        chunk_gated_delta_rule_fwd,
    )
    from fla.utils import input_guard

    return input_guard(chunk_gated_delta_rule_fwd), input_guard(chunk_gated_delta_rule_bwd)


@torch.library.custom_op("canon_titan::fla_chunk_gated_delta_rule", mutates_args=())
def _fla_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """o, the final state (empty unless asked for), and for the backward fla's chunk-local
    cumulative log decays and WY matrix A."""
    g_cumsum, o, A, final_state, _, _ = _fla_halves()[0](
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=FLA_CHUNK_SIZE,
    )
    final_state = final_state if output_final_state else q.new_empty(0, dtype=torch.float32)
    return o.to(q.dtype), final_state, g_cumsum, A


@_fla_chunk_gated_delta_rule.register_fake
def _(q, k, v, g, beta, initial_state, scale, output_final_state):
    batch, seq_len, heads, dk = q.shape
    final = (
        q.new_empty(batch, heads, dk, v.shape[-1], dtype=torch.float32)
        if output_final_state
        else q.new_empty(0, dtype=torch.float32)
    )
    return (
        q.new_empty(*q.shape[:3], v.shape[-1]),
        final,
        g.new_empty(g.shape, dtype=torch.float32),
        k.new_empty(batch, seq_len, heads, FLA_CHUNK_SIZE),
    )


@torch.library.custom_op("canon_titan::fla_chunk_gated_delta_rule_backward", mutates_args=())
def _fla_chunk_gated_delta_rule_backward(
    do: torch.Tensor,
    d_final: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_cumsum: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, db, dg, dh0, _, _ = _fla_halves()[1](
        q=q,
        k=k,
        v=v,
        g=g_cumsum,
        beta=beta,
        A=A,
        scale=scale,
        initial_state=initial_state,
        do=do,
        dht=d_final,
        chunk_size=FLA_CHUNK_SIZE,
    )
    dh0 = dh0 if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, db.to(beta.dtype), dh0


@_fla_chunk_gated_delta_rule_backward.register_fake
def _(do, d_final, q, k, v, g_cumsum, beta, A, initial_state, scale):
    dh0 = (
        initial_state.new_empty(initial_state.shape)
        if initial_state is not None
        else q.new_empty(0, dtype=torch.float32)
    )
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        g_cumsum.new_empty(g_cumsum.shape),
        beta.new_empty(beta.shape),
        dh0,
    )


def _fla_gdr_setup(ctx, inputs, output):
    q, k, v, g, beta, initial_state, ctx.scale, ctx.output_final_state = inputs
    ctx.g_dtype = g.dtype
    ctx.mark_non_differentiable(output[2], output[3])
    ctx.save_for_backward(q, k, v, output[2], beta, output[3], initial_state)


def _fla_gdr_grad(ctx, do, d_final, _d_cumsum, _dA):
    q, k, v, g_cumsum, beta, A, initial_state = ctx.saved_tensors
    d_final = d_final if ctx.output_final_state else None
    dq, dk, dv, dg, db, dh0 = torch.ops.canon_titan.fla_chunk_gated_delta_rule_backward(
        do, d_final, q, k, v, g_cumsum, beta, A, initial_state, ctx.scale
    )
    return (
        dq,
        dk,
        dv,
        dg.to(ctx.g_dtype),
        db,
        dh0 if initial_state is not None else None,
        None,
        None,
    )


_fla_chunk_gated_delta_rule.register_autograd(_fla_gdr_grad, setup_context=_fla_gdr_setup)


def gated_delta_rule_documents_forward(
    q, k, v, g, beta, scale, output_final_state, cu_seqlens, chunk_indices
):
    """The body of ``canon_titan::fla_chunk_gated_delta_rule_documents``: fla's varlen path, given
    the chunk indices so that it sizes nothing by device values (``kernels.documents``; the tests
    count its host reads, which a dispatch mode cannot see inside the op)."""
    g_cumsum, o, A, final_state, _, _ = _fla_halves()[0](
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        initial_state=None,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        chunk_size=FLA_CHUNK_SIZE,
    )
    final_state = final_state if output_final_state else q.new_empty(0, dtype=torch.float32)
    return o.to(q.dtype), final_state, g_cumsum, A


def gated_delta_rule_documents_backward(
    do, d_final, q, k, v, g_cumsum, beta, A, scale, cu_seqlens, chunk_indices
):
    """The body of ``canon_titan::fla_chunk_gated_delta_rule_documents_backward``."""
    dq, dk, dv, db, dg, _, _, _ = _fla_halves()[1](
        q=q,
        k=k,
        v=v,
        g=g_cumsum,
        beta=beta,
        A=A,
        scale=scale,
        initial_state=None,
        do=do,
        dht=d_final,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        chunk_size=FLA_CHUNK_SIZE,
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, db.to(beta.dtype)


@torch.library.custom_op("canon_titan::fla_chunk_gated_delta_rule_documents", mutates_args=())
def _fla_chunk_gated_delta_rule_documents(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    output_final_state: bool,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fla_chunk_gated_delta_rule`` on one flattened row of documents; the final states are the
    documents'."""
    return gated_delta_rule_documents_forward(
        q, k, v, g, beta, scale, output_final_state, cu_seqlens, chunk_indices
    )


@_fla_chunk_gated_delta_rule_documents.register_fake
def _(q, k, v, g, beta, scale, output_final_state, cu_seqlens, chunk_indices):
    _, seq_len, heads, dk = q.shape
    final = (
        q.new_empty(cu_seqlens.shape[0] - 1, heads, dk, v.shape[-1], dtype=torch.float32)
        if output_final_state
        else q.new_empty(0, dtype=torch.float32)
    )
    return (
        q.new_empty(*q.shape[:3], v.shape[-1]),
        final,
        g.new_empty(g.shape, dtype=torch.float32),
        k.new_empty(1, seq_len, heads, FLA_CHUNK_SIZE),
    )


@torch.library.custom_op(
    "canon_titan::fla_chunk_gated_delta_rule_documents_backward", mutates_args=()
)
def _fla_chunk_gated_delta_rule_documents_backward(
    do: torch.Tensor,
    d_final: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_cumsum: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return gated_delta_rule_documents_backward(
        do, d_final, q, k, v, g_cumsum, beta, A, scale, cu_seqlens, chunk_indices
    )


@_fla_chunk_gated_delta_rule_documents_backward.register_fake
def _(do, d_final, q, k, v, g_cumsum, beta, A, scale, cu_seqlens, chunk_indices):
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        g_cumsum.new_empty(g_cumsum.shape),
        beta.new_empty(beta.shape),
    )


def _fla_gdr_documents_setup(ctx, inputs, output):
    q, k, v, g, beta, ctx.scale, ctx.output_final_state, cu_seqlens, chunk_indices = inputs
    ctx.g_dtype = g.dtype
    ctx.mark_non_differentiable(output[2], output[3])
    ctx.save_for_backward(q, k, v, output[2], beta, output[3], cu_seqlens, chunk_indices)


def _fla_gdr_documents_grad(ctx, do, d_final, _d_cumsum, _dA):
    q, k, v, g_cumsum, beta, A, cu_seqlens, chunk_indices = ctx.saved_tensors
    d_final = d_final if ctx.output_final_state else None
    dq, dk, dv, dg, db = torch.ops.canon_titan.fla_chunk_gated_delta_rule_documents_backward(
        do, d_final, q, k, v, g_cumsum, beta, A, ctx.scale, cu_seqlens, chunk_indices
    )
    return dq, dk, dv, dg.to(ctx.g_dtype), db, None, None, None, None


_fla_chunk_gated_delta_rule_documents.register_autograd(
    _fla_gdr_documents_grad, setup_context=_fla_gdr_documents_setup
)


def _gated_delta_rule_torch(
    q, k, v, log_decay, beta, scale, chunk_size, initial_state, documents=None
):
    out_dtype, dtype, seq_len = q.dtype, compute_dtype(q.dtype), q.shape[1]
    q, k, v, g, beta = (
        to_chunks(t, chunk_size, dtype) for t in (q, k, v, log_decay, beta)
    )  # [B, H, N, C, *]
    q = q * scale
    b = g.cumsum(-1)
    masks = separate(documents, chunk_size)
    decay = kept(decay_matrix(b), masks, "same")
    strictly_lower = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    reading = kept(b.exp(), masks, "fresh")
    rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * reading).unsqueeze(-1) * k], dim=-1)
    # unitriangular: the zero diagonal of strictly_lower is read as ones.
    solved = torch.linalg.solve_triangular(strictly_lower, rhs, upper=False, unitriangular=True)
    u_local, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    k_to_end = k * kept((b[..., -1:] - b).exp(), masks, "last").unsqueeze(-1)
    chunk_decay = kept(b[..., -1].exp(), masks, "carried")[..., None, None]

    state = (
        q.new_zeros(*q.shape[:2], k.shape[-1], v.shape[-1])
        if initial_state is None
        else initial_state.to(dtype)
    )
    entering, corrections = [], []
    # unbind, not indexing: the backward of each index would write a whole zero tensor.
    for u_local_n, w_n, decay_n, k_n in zip(
        u_local.unbind(2), w.unbind(2), chunk_decay.unbind(2), k_to_end.unbind(2)
    ):
        entering.append(state)
        u = u_local_n - w_n @ state
        corrections.append(u)
        state = decay_n * state + k_n.transpose(-1, -2) @ u
    entering, u = torch.stack(entering, dim=2), torch.stack(corrections, dim=2)
    reading = kept(b.exp(), masks, "fresh")
    o = (q * reading.unsqueeze(-1)) @ entering + ((q @ k.transpose(-1, -2)) * decay) @ u
    return from_chunks(o, seq_len, out_dtype), state
