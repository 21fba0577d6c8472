"""Mamba2 state-space duality (SSD) scan, in mamba_ssm's convention (``mamba_chunk_scan_combined``):

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t + D x_t

x: [B, T, H, P]; dt: [B, T, H], already positive (softplus and bias applied by the caller);
A: [H], negative; B, C: [B, T, G, N], head h reading group h // (H // G); D: [H]; h: [B, H, P, N].

The torch kernel works on chunks: within a chunk y = (C B^T * L) (dt x) with L_ij = exp(b_i - b_j)
for j <= i (b the cumulative dt A from the chunk start, exponentiated only where <= 0), plus the
entering state read through C; across chunks, a loop carries the state.
"""

from __future__ import annotations

import torch

from canon_titan.kernels.backends import (compute_dtype, decay_matrix, from_chunks, resolve_backend, scan_states,
                                          to_chunks)


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
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns y [B, T, H, P] in x's dtype and, if asked, the final state [B, H, P, N] (float32, or
    float64 for double inputs). ``chunk_size`` is also passed to mamba_ssm."""
    if x.shape[2] % B.shape[2]:
        raise ValueError(f"ssd: {x.shape[2]} heads do not split into {B.shape[2]} groups")
    if resolve_backend(backend, x.device, op="ssd") == "mamba_ssm":
        return _ssd_mamba(x, dt, A, B, C, D, chunk_size, initial_state, output_final_state)
    y, final_state = _ssd_torch(x, dt, A, B, C, D, chunk_size, initial_state)
    return y, final_state if output_final_state else None


@torch.compiler.disable
def _ssd_mamba(x, dt, A, B, C, D, chunk_size, initial_state, output_final_state):
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    out = mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, initial_states=initial_state,
                                    return_final_states=output_final_state)
    # It returns the bare output unless asked for the final states.
    return out if output_final_state else (out, None)


def _ssd_torch(x, dt, A, B, C, D, chunk_size, initial_state):
    out_dtype, dtype, seq_len = x.dtype, compute_dtype(x.dtype), x.shape[1]
    heads, groups = x.shape[2], B.shape[2]
    x, dt, B, C = (to_chunks(t, chunk_size, dtype) for t in (x, dt, B, C))  # [B, H or G, N, L, *]
    b = (dt * A.to(dtype)[:, None, None]).cumsum(-1)

    def by_group(t):  # [B, H, ...] -> [B, G, H // G, ...]
        return t.unflatten(1, (groups, heads // groups))

    dt_x = x * dt.unsqueeze(-1)
    B, C = B.unsqueeze(2), C.unsqueeze(2)  # [B, G, 1, N, L, state]
    scores = (C @ B.transpose(-1, -2)) * by_group(decay_matrix(b))
    y = scores @ by_group(dt_x)

    b_last = b[..., -1:]
    updates = by_group(dt_x * (b_last - b).exp().unsqueeze(-1)).transpose(-1, -2) @ B  # [B, G, H/G, N, P, state]
    entering, final_state = scan_states(b_last.exp().unsqueeze(-1), updates.flatten(1, 2), initial_state)
    y = y + (C @ by_group(entering).transpose(-1, -2)) * by_group(b.exp().unsqueeze(-1))
    y = y.flatten(1, 2)
    if D is not None:
        y = y + D.to(dtype)[:, None, None, None] * x
    return from_chunks(y, seq_len, out_dtype), final_state
