"""Gated delta rule (GatedDeltaNet, GDN2), in fla's convention (``naive_recurrent_gated_delta_rule``):

    S'  = exp(g_t) S_{t-1}
    u_t = beta_t (v_t - S'^T k_t)
    S_t = S' + k_t u_t^T                    i.e. S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * q_t S_t

q, k: [B, T, H, K]; v: [B, T, H, V]; g (log decay, <= 0) and beta: [B, T, H]; S: [B, H, K, V].
The caller L2-normalises q and k.

The torch kernel is the chunked WY form. With b the cumulative log decay from the chunk start and
S0 the state entering the chunk, the corrections of one chunk satisfy
    u_i + beta_i sum_{j<i} exp(b_i - b_j) (k_i . k_j) u_j = beta_i v_i - beta_i exp(b_i) k_i^T S0,
a unit lower-triangular system solved once for both right-hand sides (u = U - W S0); only the
[C, K] x [K, V] products that involve S0 stay in the loop over chunks.
"""

from __future__ import annotations

import torch

from canon_titan.kernels.backends import compute_dtype, decay_matrix, from_chunks, resolve_backend, to_chunks


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
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns o [B, T, H, V] in q's dtype and, if asked, the final state [B, H, K, V] (float32, or
    float64 for double inputs). ``scale`` defaults to K**-0.5. ``chunk_size`` is the torch kernel's
    block length; fla uses its default (64)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if resolve_backend(backend, q.device, op="gated_delta_rule") == "fla":
        return _gated_delta_rule_fla(q, k, v, log_decay, beta, scale, initial_state, output_final_state)
    o, final_state = _gated_delta_rule_torch(q, k, v, log_decay, beta, scale, chunk_size, initial_state)
    return o, final_state if output_final_state else None


@torch.compiler.disable
def _gated_delta_rule_fla(q, k, v, log_decay, beta, scale, initial_state, output_final_state):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    h0 = None if initial_state is None else initial_state.float()
    return chunk_gated_delta_rule(q, k, v, g=log_decay, beta=beta, scale=scale, initial_state=h0,
                                  output_final_state=output_final_state)


def _gated_delta_rule_torch(q, k, v, log_decay, beta, scale, chunk_size, initial_state):
    out_dtype, dtype, seq_len = q.dtype, compute_dtype(q.dtype), q.shape[1]
    q, k, v, g, beta = (to_chunks(t, chunk_size, dtype) for t in (q, k, v, log_decay, beta))  # [B, H, N, C, *]
    q = q * scale
    b = g.cumsum(-1)
    decay = decay_matrix(b)
    strictly_lower = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * b.exp()).unsqueeze(-1) * k], dim=-1)
    # unitriangular: the zero diagonal of strictly_lower is read as ones.
    solved = torch.linalg.solve_triangular(strictly_lower, rhs, upper=False, unitriangular=True)
    u_local, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    k_to_end = k * (b[..., -1:] - b).exp().unsqueeze(-1)
    chunk_decay = b[..., -1].exp()[..., None, None]

    state = q.new_zeros(*q.shape[:2], k.shape[-1], v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    entering, corrections = [], []
    # unbind, not indexing: the backward of each index would write a whole zero tensor.
    for u_local_n, w_n, decay_n, k_n in zip(u_local.unbind(2), w.unbind(2), chunk_decay.unbind(2), k_to_end.unbind(2)):
        entering.append(state)
        u = u_local_n - w_n @ state
        corrections.append(u)
        state = decay_n * state + k_n.transpose(-1, -2) @ u
    entering, u = torch.stack(entering, dim=2), torch.stack(corrections, dim=2)
    o = (q * b.exp().unsqueeze(-1)) @ entering + ((q @ k.transpose(-1, -2)) * decay) @ u
    return from_chunks(o, seq_len, out_dtype), state
