"""Mamba2 state-space duality (SSD) scan, in mamba_ssm's convention (``mamba_chunk_scan_combined``):

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t + D x_t

x: [B, T, H, P]; dt: [B, T, H], already positive (softplus and bias applied by the caller);
A: [H], negative; B, C: [B, T, G, N], head h reading group h // (H // G); D: [H]; h: [B, H, P, N].

The torch kernel works on chunks: within a chunk y = (C B^T * L) (dt x) with L_ij = exp(b_i - b_j)
for j <= i (b the cumulative dt A from the chunk start, exponentiated only where <= 0), plus the
entering state read through C; across chunks, a loop carries the state.

Backends: ``torch`` (below) and ``mamba_ssm``, mamba-ssm's Triton SSD kernels
(``_mamba_chunk_scan_combined_fwd`` / ``_bwd``, the halves of its ``MambaChunkScanCombinedFn``)
behind the custom ops ``canon_titan::mamba_chunk_scan`` and its backward.
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
    scan_states,
    to_chunks,
)
from canon_titan.kernels.documents import Documents, kept, separate


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    documents: Documents | None = None,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns y [B, T, H, P] in x's dtype and, if asked, the final state [B, H, P, N] (float32, or
    float64 for double inputs). ``chunk_size`` is also passed to mamba_ssm. With ``documents`` each
    packed document starts from a zero state (mamba-ssm's ``seq_idx``; every row starts one, so
    there is no initial state) and the final state is each row's last document's."""
    if x.shape[2] % B.shape[2]:
        raise ValueError(f"ssd: {x.shape[2]} heads do not split into {B.shape[2]} groups")
    if documents is not None and initial_state is not None:
        raise ValueError("ssd: packed documents each start from a zero state; no initial_state")
    if runs_cuda_kernel(backend, x) and documents is not None:
        y, final_state = torch.ops.canon_titan.mamba_chunk_scan_documents(
            x, dt, A, B, C, D, chunk_size, output_final_state, documents.seq_idx()
        )
        return y, final_state if output_final_state else None
    if runs_cuda_kernel(backend, x):
        y, final_state = torch.ops.canon_titan.mamba_chunk_scan(
            x, dt, A, B, C, D, initial_state, chunk_size, output_final_state
        )
        return y, final_state if output_final_state else None
    y, final_state = _ssd_torch(x, dt, A, B, C, D, chunk_size, initial_state, documents)
    return y, final_state if output_final_state else None


@functools.cache
def _mamba_halves():
    """mamba-ssm's forward and backward halves of ``MambaChunkScanCombinedFn``, imported once."""
    prepare_kernels("mamba_ssm")
    from mamba_ssm.ops.triton.ssd_combined import (
        _mamba_chunk_scan_combined_bwd,
        _mamba_chunk_scan_combined_fwd,
    )

    return _mamba_chunk_scan_combined_fwd, _mamba_chunk_scan_combined_bwd


@torch.library.custom_op("canon_titan::mamba_chunk_scan", mutates_args=())
def _mamba_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    chunk_size: int,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y and the final state (empty unless asked for)."""
    y, _, _, _, _, final_state, *_ = _mamba_halves()[0](
        x, dt, A, B, C, chunk_size, D=D, initial_states=initial_state
    )
    return y.to(x.dtype), final_state if output_final_state else x.new_empty(0, dtype=torch.float32)


@_mamba_chunk_scan.register_fake
def _(x, dt, A, B, C, D, initial_state, chunk_size, output_final_state):
    batch, _, heads, head_dim = x.shape
    final = (
        x.new_empty(batch, heads, head_dim, B.shape[-1], dtype=torch.float32)
        if output_final_state
        else x.new_empty(0, dtype=torch.float32)
    )
    return x.new_empty(x.shape), final


@torch.library.custom_op("canon_titan::mamba_chunk_scan_backward", mutates_args=())
def _mamba_chunk_scan_backward(
    dy: torch.Tensor,
    d_final: torch.Tensor | None,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    y: torch.Tensor,
    chunk_size: int,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    dx, ddt, dA, dB, dC, dD, _, _, dh0 = _mamba_halves()[1](
        dy.contiguous(),
        x,
        dt,
        A,
        B,
        C,
        y,
        chunk_size,
        D=D,
        initial_states=initial_state,
        dfinal_states=d_final.contiguous() if d_final is not None else None,
    )
    empty = x.new_empty(0, dtype=torch.float32)
    return (
        dx.to(x.dtype),
        ddt.to(dt.dtype),
        dA.to(A.dtype),
        dB.to(B.dtype),
        dC.to(C.dtype),
        dD.to(D.dtype) if D is not None else empty,
        dh0 if initial_state is not None else empty,
    )


@_mamba_chunk_scan_backward.register_fake
def _(dy, d_final, x, dt, A, B, C, D, initial_state, y, chunk_size):
    empty = x.new_empty(0, dtype=torch.float32)
    return (
        x.new_empty(x.shape),
        dt.new_empty(dt.shape),
        A.new_empty(A.shape),
        B.new_empty(B.shape),
        C.new_empty(C.shape),
        D.new_empty(D.shape) if D is not None else empty,
        initial_state.new_empty(initial_state.shape) if initial_state is not None else empty,
    )


def _mamba_setup(ctx, inputs, output):
    x, dt, A, B, C, D, initial_state, ctx.chunk_size, ctx.output_final_state = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, initial_state, output[0])


def _mamba_grad(ctx, dy, d_final):
    x, dt, A, B, C, D, initial_state, y = ctx.saved_tensors
    d_final = d_final if ctx.output_final_state else None
    dx, ddt, dA, dB, dC, dD, dh0 = torch.ops.canon_titan.mamba_chunk_scan_backward(
        dy, d_final, x, dt, A, B, C, D, initial_state, y, ctx.chunk_size
    )
    return (
        dx,
        ddt,
        dA,
        dB,
        dC,
        dD if D is not None else None,
        dh0 if initial_state is not None else None,
        None,
        None,
    )


_mamba_chunk_scan.register_autograd(_mamba_grad, setup_context=_mamba_setup)


def ssd_documents_forward(x, dt, A, B, C, D, chunk_size, output_final_state, seq_idx):
    """The body of ``canon_titan::mamba_chunk_scan_documents`` (the tests count its host reads,
    which a dispatch mode cannot see inside the op)."""
    y, _, _, _, _, final_state, *_ = _mamba_halves()[0](
        x, dt, A, B, C, chunk_size, D=D, seq_idx=seq_idx
    )
    return y.to(x.dtype), final_state if output_final_state else x.new_empty(0, dtype=torch.float32)


def ssd_documents_backward(dy, d_final, x, dt, A, B, C, D, y, chunk_size, seq_idx):
    """The body of ``canon_titan::mamba_chunk_scan_documents_backward``."""
    dx, ddt, dA, dB, dC, dD, _, _, _ = _mamba_halves()[1](
        dy.contiguous(),
        x,
        dt,
        A,
        B,
        C,
        y,
        chunk_size,
        D=D,
        seq_idx=seq_idx,
        dfinal_states=d_final.contiguous() if d_final is not None else None,
    )
    return (
        dx.to(x.dtype),
        ddt.to(dt.dtype),
        dA.to(A.dtype),
        dB.to(B.dtype),
        dC.to(C.dtype),
        dD.to(D.dtype) if D is not None else x.new_empty(0, dtype=torch.float32),
    )


@torch.library.custom_op("canon_titan::mamba_chunk_scan_documents", mutates_args=())
def _mamba_chunk_scan_documents(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    chunk_size: int,
    output_final_state: bool,
    seq_idx: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mamba_chunk_scan`` with the documents of each row apart (``seq_idx``: each token's document
    number in its row); the final state is each row's last document's."""
    return ssd_documents_forward(x, dt, A, B, C, D, chunk_size, output_final_state, seq_idx)


@_mamba_chunk_scan_documents.register_fake
def _(x, dt, A, B, C, D, chunk_size, output_final_state, seq_idx):
    batch, _, heads, head_dim = x.shape
    final = (
        x.new_empty(batch, heads, head_dim, B.shape[-1], dtype=torch.float32)
        if output_final_state
        else x.new_empty(0, dtype=torch.float32)
    )
    return x.new_empty(x.shape), final


@torch.library.custom_op("canon_titan::mamba_chunk_scan_documents_backward", mutates_args=())
def _mamba_chunk_scan_documents_backward(
    dy: torch.Tensor,
    d_final: torch.Tensor | None,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    y: torch.Tensor,
    chunk_size: int,
    seq_idx: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return ssd_documents_backward(dy, d_final, x, dt, A, B, C, D, y, chunk_size, seq_idx)


@_mamba_chunk_scan_documents_backward.register_fake
def _(dy, d_final, x, dt, A, B, C, D, y, chunk_size, seq_idx):
    return (
        x.new_empty(x.shape),
        dt.new_empty(dt.shape),
        A.new_empty(A.shape),
        B.new_empty(B.shape),
        C.new_empty(C.shape),
        D.new_empty(D.shape) if D is not None else x.new_empty(0, dtype=torch.float32),
    )


def _mamba_documents_setup(ctx, inputs, output):
    x, dt, A, B, C, D, ctx.chunk_size, ctx.output_final_state, seq_idx = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, output[0], seq_idx)


def _mamba_documents_grad(ctx, dy, d_final):
    x, dt, A, B, C, D, y, seq_idx = ctx.saved_tensors
    d_final = d_final if ctx.output_final_state else None
    dx, ddt, dA, dB, dC, dD = torch.ops.canon_titan.mamba_chunk_scan_documents_backward(
        dy, d_final, x, dt, A, B, C, D, y, ctx.chunk_size, seq_idx
    )
    return dx, ddt, dA, dB, dC, dD if D is not None else None, None, None, None


_mamba_chunk_scan_documents.register_autograd(
    _mamba_documents_grad, setup_context=_mamba_documents_setup
)


def _ssd_torch(x, dt, A, B, C, D, chunk_size, initial_state, documents=None):
    out_dtype, dtype, seq_len = x.dtype, compute_dtype(x.dtype), x.shape[1]
    heads, groups = x.shape[2], B.shape[2]
    x, dt, B, C = (to_chunks(t, chunk_size, dtype) for t in (x, dt, B, C))  # [B, H or G, N, L, *]
    b = (dt * A.to(dtype)[:, None, None]).cumsum(-1)

    def by_group(t):  # [B, H, ...] -> [B, G, H // G, ...]
        return t.unflatten(1, (groups, heads // groups))

    masks = separate(documents, chunk_size)
    dt_x = x * dt.unsqueeze(-1)
    B, C = B.unsqueeze(2), C.unsqueeze(2)  # [B, G, 1, N, L, state]
    scores = (C @ B.transpose(-1, -2)) * by_group(kept(decay_matrix(b), masks, "same"))
    y = scores @ by_group(dt_x)

    b_last = b[..., -1:]
    leaving = kept((b_last - b).exp(), masks, "last")
    # [B, G, H/G, N, P, state]
    updates = by_group(dt_x * leaving.unsqueeze(-1)).transpose(-1, -2) @ B
    carried = kept(b_last.exp(), masks, "carried")
    entering, final_state = scan_states(carried.unsqueeze(-1), updates.flatten(1, 2), initial_state)
    reading = kept(b.exp(), masks, "fresh")
    y = y + (C @ by_group(entering).transpose(-1, -2)) * by_group(reading.unsqueeze(-1))
    y = y.flatten(1, 2)
    if D is not None:
        y = y + D.to(dtype)[:, None, None, None] * x
    return from_chunks(y, seq_len, out_dtype), final_state
