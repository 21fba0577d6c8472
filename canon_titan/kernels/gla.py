"""Gated linear attention (GLA) with a per-key-dimension forget gate.

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,    o_t = scale * q_t S_t

q, k, g: [B, T, H, K]; v: [B, T, H, V]; g <= 0 is the log forget gate; S: [B, H, K, V].
Same convention as fla's ``chunk_gla`` and ``naive_recurrent_gla``.

Backends: ``torch`` (below) and ``fla``, fla 0.6.0's chunked Triton kernels (``chunk_gla_fwd`` /
``chunk_gla_bwd``, the two halves of its ``ChunkGLAFunction``) behind the custom ops
``canon_titan::fla_chunk_gla`` and its backward, which fla's own entry point (compile-disabled)
is not.

The torch kernel works on chunks of ``chunk_size`` tokens: within a chunk, masked matmuls; across
chunks, a loop that carries the state. Decays are cumulative log gates b from the chunk start, and
exp is only ever taken of differences b_i - b_j with i later than j (<= 0), so strong gates cannot
overflow. Pairs inside a chunk go by sub-chunks of gcd(chunk_size, SUB_CHUNK) tokens: a query
sub-chunk reaches earlier sub-chunks through the log decay r just before it, exp(b_i - b_j) =
exp(b_i - r) * exp(r - b_j) with both factors <= 1, and only pairs inside one sub-chunk need the
[sub, sub, K] tensor of pairwise decays (16, as in fla; 8 and 32 were no faster on CPU).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
import triton
from torch.utils._pytree import tree_map

from canon_titan.kernels.backends import (
    compute_dtype,
    from_chunks,
    prepare_kernels,
    runs_cuda_kernel,
    scan_states,
    to_chunks,
)
from canon_titan.kernels.documents import FLA_CHUNK, Documents, kept, separate

SUB_CHUNK = 16


def gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gate: torch.Tensor,
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
    block length; fla chooses its own. With ``documents`` each packed document starts from a zero
    state (every row starts one, so there is no initial state) and the final state is each row's
    last document's."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if documents is not None and initial_state is not None:
        raise ValueError("gla: packed documents each start from a zero state; no initial_state")
    if runs_cuda_kernel(backend, q) and documents is not None:
        return _fla_gla_documents(q, k, v, log_gate, scale, output_final_state, documents)
    if runs_cuda_kernel(backend, q):
        # fla keeps the state in float32.
        h0 = None if initial_state is None else initial_state.float()
        o, final_state, _ = torch.ops.canon_titan.fla_chunk_gla(
            q, k, v, log_gate, h0, scale, output_final_state
        )
        return o, final_state if output_final_state else None
    o, final_state = _gla_torch(q, k, v, log_gate, scale, chunk_size, initial_state, documents)
    return o, final_state if output_final_state else None


def _fla_gla_documents(q, k, v, log_gate, scale, output_final_state, documents):
    """fla's varlen kernels on the batch flattened to one row."""
    batch, seq_len = q.shape[:2]
    cu_seqlens, chunk_indices = documents.fla_layout()
    flat = [t.reshape(1, batch * seq_len, *t.shape[2:]) for t in (q, k, v, log_gate)]
    o, final_state, _ = torch.ops.canon_titan.fla_chunk_gla_documents(
        *flat, scale, output_final_state, cu_seqlens, chunk_indices, documents.positions.reshape(-1)
    )
    o = o.view(batch, seq_len, *o.shape[2:])
    return o, final_state.index_select(0, documents.row_ends()) if output_final_state else None


def _fla_chunk_size(seq_len: int) -> int:
    """The block length ChunkGLAFunction uses."""
    return min(64, max(16, triton.next_power_of_2(seq_len)))


@functools.cache
def _fla_halves():
    """fla's forward and backward halves of ``ChunkGLAFunction``, each under fla's ``input_guard``
    (its kernels assume contiguous [B, T, H, K] and launch on the current device). Guarded once:
    ``input_guard`` reads the function's signature each time it wraps one, a few hundred Python
    calls on every op call."""
    prepare_kernels("fla")
    from fla.ops.gla.chunk import chunk_gla_bwd, chunk_gla_fwd
    from fla.utils import input_guard

    return input_guard(chunk_gla_fwd), input_guard(chunk_gla_bwd)


@functools.lru_cache(maxsize=8)
def _unwritten(seq_len: int, chunk_size: int, device: torch.device) -> torch.Tensor:
    """[T, 1, chunk]: where fla leaves A unwritten (key j after query t within the chunk), made once
    per shape."""
    position = torch.arange(seq_len, device=device) % chunk_size
    return torch.arange(chunk_size, device=device) > position[:, None, None]


@torch.library.custom_op("canon_titan::fla_chunk_gla", mutates_args=())
def _fla_chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """o, the final state (empty unless asked for) and fla's intra-chunk scores A (for the
    backward)."""
    chunk_size = _fla_chunk_size(q.shape[1])
    _, A, _, final_state, o = _fla_halves()[0](
        q=q,
        k=k,
        v=v,
        g=g,
        g_cumsum=None,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
    )
    # fla writes A [B, T, H, chunk] only where key j <= query t within the chunk; an op's outputs
    # must not carry uninitialised memory (compiled and eager runs would differ there).
    A.masked_fill_(_unwritten(q.shape[1], chunk_size, A.device), 0.0)
    final_state = final_state if output_final_state else q.new_empty(0, dtype=torch.float32)
    return o.to(q.dtype), final_state, A


@_fla_chunk_gla.register_fake
def _(q, k, v, g, initial_state, scale, output_final_state):
    batch, seq_len, heads, dk = q.shape
    final = (
        q.new_empty(batch, heads, dk, v.shape[-1], dtype=torch.float32)
        if output_final_state
        else q.new_empty(0, dtype=torch.float32)
    )
    A = q.new_empty(batch, seq_len, heads, _fla_chunk_size(seq_len), dtype=torch.float32)
    return q.new_empty(*q.shape[:3], v.shape[-1]), final, A


@torch.library.custom_op("canon_titan::fla_chunk_gla_backward", mutates_args=())
def _fla_chunk_gla_backward(
    do: torch.Tensor,
    d_final: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor | None,
    A: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dg, dh0 = _fla_halves()[1](
        q=q,
        k=k,
        v=v,
        g=g,
        g_cumsum=None,
        scale=scale,
        initial_state=initial_state,
        h=None,
        A=A,
        do=do,
        dht=d_final,
        chunk_size=_fla_chunk_size(q.shape[1]),
    )
    dh0 = dh0 if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dh0


@_fla_chunk_gla_backward.register_fake
def _(do, d_final, q, k, v, g, initial_state, A, scale):
    dh0 = (
        initial_state.new_empty(initial_state.shape)
        if initial_state is not None
        else q.new_empty(0, dtype=torch.float32)
    )
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        g.new_empty(g.shape),
        dh0,
    )


def _fla_chunk_gla_setup(ctx, inputs, output):
    q, k, v, g, initial_state, ctx.scale, ctx.output_final_state = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(q, k, v, g, initial_state, output[2])


def _fla_chunk_gla_grad(ctx, do, d_final, _dA):
    q, k, v, g, initial_state, A = ctx.saved_tensors
    d_final = d_final if ctx.output_final_state else None
    dq, dk, dv, dg, dh0 = torch.ops.canon_titan.fla_chunk_gla_backward(
        do, d_final, q, k, v, g, initial_state, A, ctx.scale
    )
    return dq, dk, dv, dg, dh0 if initial_state is not None else None, None, None


_fla_chunk_gla.register_autograd(_fla_chunk_gla_grad, setup_context=_fla_chunk_gla_setup)


# --- with document boundaries: fla's varlen path -----------------------------------------------
#
# The same halves with ``cu_seqlens`` and ``chunk_indices`` (``kernels.documents``), the cumulative
# gates computed here from the chunk indices (fla's halves would build those from ``cu_seqlens`` on
# the device, sizing a tensor by its values: a host read). fla's state kernels read the chunk count
# back with ``.item()`` (``chunk_fwd_h``, ``chunk_bwd_dh``), which on a GPU waits for every kernel
# queued before; the host knows it already (``len(chunk_indices)``), and ``_CountedOffsets`` tells
# them.


class _CountedOffsets(torch.Tensor):
    """fla's per-document chunk offsets (on the device) whose last entry, the chunk count, the host
    knows. Any op on it is the plain tensor's (also under a dispatch mode, which defers to the
    subclass)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(t):
            return t.plain if isinstance(t, cls) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))

    def __getitem__(self, index):
        return torch.tensor(self.count) if index == -1 else super().__getitem__(index)


_chunk_counts: dict[int, tuple[torch.Tensor, int]] = {}
"""id(cu_seqlens) -> (cu_seqlens, chunk count) for the documents a varlen call is running."""


@functools.cache
def _count_offsets_on_the_host():
    """The one patch of fla: its state kernels' ``prepare_chunk_offsets``
    (``fla.ops.common.chunk_h``) answers with ``_CountedOffsets`` for the documents of a call here;
    elsewhere it is fla's own. tests/test_upstream.py pins the lines it answers for."""
    from fla.ops.common import chunk_h

    original = chunk_h.prepare_chunk_offsets

    def prepare_chunk_offsets(cu_seqlens, chunk_size):
        offsets = original(cu_seqlens, chunk_size)
        known = _chunk_counts.get(id(cu_seqlens))
        if known is None or known[0] is not cu_seqlens or chunk_size != FLA_CHUNK:
            return offsets
        counted = offsets.as_subclass(_CountedOffsets)
        counted.plain, counted.count = offsets, known[1]
        return counted

    chunk_h.prepare_chunk_offsets = prepare_chunk_offsets


@contextlib.contextmanager
def _chunk_count_known(cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor):
    _count_offsets_on_the_host()
    _chunk_counts[id(cu_seqlens)] = (cu_seqlens, len(chunk_indices))
    try:
        yield
    finally:
        del _chunk_counts[id(cu_seqlens)]


def _gate_cumsum(g, cu_seqlens, chunk_indices):
    """fla's cumulative log2 gates per chunk of each document, as ``chunk_gla_fwd`` computes
    them."""
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.cumsum import chunk_local_cumsum

    return chunk_local_cumsum(
        g, FLA_CHUNK, scale=RCP_LN2, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices
    )


def gla_documents_forward(
    q, k, v, g, scale, output_final_state, cu_seqlens, chunk_indices, positions
):
    """The body of ``canon_titan::fla_chunk_gla_documents`` (``tests/test_kernel_backends.py``
    counts its host reads, which a dispatch mode cannot see inside the op)."""
    with _chunk_count_known(cu_seqlens, chunk_indices):
        _, A, _, final_state, o = _fla_halves()[0](
            q=q,
            k=k,
            v=v,
            g=None,
            g_cumsum=_gate_cumsum(g, cu_seqlens, chunk_indices),
            scale=scale,
            initial_state=None,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            chunk_size=FLA_CHUNK,
            chunk_indices=chunk_indices,
        )
    # Chunks start at each document's start: A is written where key j <= the query's place in its
    # chunk.
    A.masked_fill_(
        torch.arange(FLA_CHUNK, device=A.device) > (positions % FLA_CHUNK)[:, None, None], 0.0
    )
    final_state = final_state if output_final_state else q.new_empty(0, dtype=torch.float32)
    return o.to(q.dtype), final_state, A


def gla_documents_backward(do, d_final, q, k, v, g, A, scale, cu_seqlens, chunk_indices):
    """The body of ``canon_titan::fla_chunk_gla_documents_backward``."""
    with _chunk_count_known(cu_seqlens, chunk_indices):
        dq, dk, dv, dg, _ = _fla_halves()[1](
            q=q,
            k=k,
            v=v,
            g=None,
            g_cumsum=_gate_cumsum(g, cu_seqlens, chunk_indices),
            scale=scale,
            initial_state=None,
            h=None,
            A=A,
            do=do,
            dht=d_final,
            cu_seqlens=cu_seqlens,
            chunk_size=FLA_CHUNK,
            chunk_indices=chunk_indices,
        )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype)


@torch.library.custom_op("canon_titan::fla_chunk_gla_documents", mutates_args=())
def _fla_chunk_gla_documents(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float,
    output_final_state: bool,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fla_chunk_gla`` on one flattened row of documents (``positions``: each token's place in its
    document); the final states are the documents'."""
    return gla_documents_forward(
        q, k, v, g, scale, output_final_state, cu_seqlens, chunk_indices, positions
    )


@_fla_chunk_gla_documents.register_fake
def _(q, k, v, g, scale, output_final_state, cu_seqlens, chunk_indices, positions):
    _, seq_len, heads, dk = q.shape
    final = (
        q.new_empty(cu_seqlens.shape[0] - 1, heads, dk, v.shape[-1], dtype=torch.float32)
        if output_final_state
        else q.new_empty(0, dtype=torch.float32)
    )
    A = q.new_empty(1, seq_len, heads, FLA_CHUNK, dtype=torch.float32)
    return q.new_empty(*q.shape[:3], v.shape[-1]), final, A


@torch.library.custom_op("canon_titan::fla_chunk_gla_documents_backward", mutates_args=())
def _fla_chunk_gla_documents_backward(
    do: torch.Tensor,
    d_final: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    A: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return gla_documents_backward(do, d_final, q, k, v, g, A, scale, cu_seqlens, chunk_indices)


@_fla_chunk_gla_documents_backward.register_fake
def _(do, d_final, q, k, v, g, A, scale, cu_seqlens, chunk_indices):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape)


def _fla_documents_setup(ctx, inputs, output):
    q, k, v, g, ctx.scale, ctx.output_final_state, cu_seqlens, chunk_indices, _ = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(q, k, v, g, output[2], cu_seqlens, chunk_indices)


def _fla_documents_grad(ctx, do, d_final, _dA):
    q, k, v, g, A, cu_seqlens, chunk_indices = ctx.saved_tensors
    d_final = d_final if ctx.output_final_state else None
    grads = torch.ops.canon_titan.fla_chunk_gla_documents_backward(
        do, d_final, q, k, v, g, A, ctx.scale, cu_seqlens, chunk_indices
    )
    return *grads, None, None, None, None, None


_fla_chunk_gla_documents.register_autograd(_fla_documents_grad, setup_context=_fla_documents_setup)


def _gla_torch(q, k, v, log_gate, scale, chunk_size, initial_state, documents=None):
    out_dtype, dtype, seq_len = q.dtype, compute_dtype(q.dtype), q.shape[1]
    q, k, v, g = (to_chunks(t, chunk_size, dtype) for t in (q, k, v, log_gate))  # [B, H, N, C, *]
    q = q * scale
    b = g.cumsum(-2)
    b_last = b[..., -1:, :]
    masks = separate(documents, chunk_size)
    updates = (k * kept((b_last - b).exp(), masks, "last")).transpose(-1, -2) @ v
    entering, final_state = scan_states(
        kept(b_last.transpose(-1, -2).exp(), masks, "carried"), updates, initial_state
    )
    same = None if masks is None else masks["same"]
    o = (q * kept(b.exp(), masks, "fresh")) @ entering + _within_chunks(q, k, v, b, same)
    return from_chunks(o, seq_len, out_dtype), final_state


def _within_chunks(q, k, v, b, same=None):
    """sum_{j <= i in the chunk} (q_i * exp(b_i - b_j)) . k_j  v_j for every position i (only j in
    i's document where ``same`` [B, 1, N, C, C] says which pairs share one)."""
    chunk_size = q.shape[-2]
    sub = math.gcd(chunk_size, SUB_CHUNK)
    n_sub = chunk_size // sub
    qs, ks, vs, bs = (
        t.unflatten(-2, (n_sub, sub)) for t in (q, k, v, b)
    )  # [B, H, N, n_sub, sub, *]

    # Earlier sub-chunks, through r = log decay just before each sub-chunk (0 before the first).
    r = F.pad(bs[..., :-1, -1, :], (0, 0, 1, 0)).unsqueeze(-2)  # [B, H, N, n_sub, 1, K]
    q_r = qs * (bs - r).exp()
    start = torch.arange(n_sub, device=q.device).unsqueeze(-1) * sub
    earlier = torch.arange(chunk_size, device=q.device) < start  # [n_sub, C]
    k_r = (
        k.unsqueeze(-3)
        * (r - b.unsqueeze(-3)).masked_fill(~earlier.unsqueeze(-1), float("-inf")).exp()
    )
    earlier_scores = q_r @ k_r.transpose(-1, -2)  # [B, H, N, n_sub, sub, C]
    if same is not None:
        same = same.unflatten(-2, (n_sub, sub))  # [B, 1, N, n_sub, sub, C]
        earlier_scores = earlier_scores * same
    o = earlier_scores @ v.unsqueeze(-3)

    # Same sub-chunk: pairwise decays.
    causal = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril().unsqueeze(-1)
    pair_decay = (bs.unsqueeze(-2) - bs.unsqueeze(-3)).masked_fill(~causal, float("-inf")).exp()
    scores = (qs.unsqueeze(-2) * ks.unsqueeze(-3) * pair_decay).sum(-1)
    if same is not None:  # each query sub-chunk's own columns
        own = same.unflatten(-1, (n_sub, sub)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
        scores = scores * own
    return (o + scores @ vs).flatten(-3, -2)
