"""Gated linear attention (GLA) with a per-key-dimension forget gate.

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,    o_t = scale * q_t S_t

q, k, g: [B, T, H, K]; v: [B, T, H, V]; g <= 0 is the log forget gate; S: [B, H, K, V].
Same convention as fla's ``chunk_gla`` and ``naive_recurrent_gla``.

The torch kernel works on chunks of ``chunk_size`` tokens: within a chunk, masked matmuls; across
chunks, a loop that carries the state. Decays are cumulative log gates b from the chunk start, and
exp is only ever taken of differences b_i - b_j with i later than j (<= 0), so strong gates cannot
overflow. Pairs inside a chunk go by sub-chunks of gcd(chunk_size, SUB_CHUNK) tokens: a query
sub-chunk reaches earlier sub-chunks through the log decay r just before it, exp(b_i - b_j) =
exp(b_i - r) * exp(r - b_j) with both factors <= 1, and only pairs inside one sub-chunk need the
[sub, sub, K] tensor of pairwise decays (16, as in fla; 8 and 32 were no faster on CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from canon_titan.kernels.backends import compute_dtype, from_chunks, resolve_backend, scan_states, to_chunks

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
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns o [B, T, H, V] in q's dtype and, if asked, the final state [B, H, K, V] (float32, or
    float64 for double inputs). ``scale`` defaults to K**-0.5. ``chunk_size`` is the torch kernel's
    block length; fla chooses its own."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if resolve_backend(backend, q.device, op="gla") == "fla":
        return _gla_fla(q, k, v, log_gate, scale, initial_state, output_final_state)
    o, final_state = _gla_torch(q, k, v, log_gate, scale, chunk_size, initial_state)
    return o, final_state if output_final_state else None


@torch.compiler.disable
def _gla_fla(q, k, v, log_gate, scale, initial_state, output_final_state):
    from fla.ops.gla import chunk_gla

    # chunk_gla asserts a float32 initial state.
    h0 = None if initial_state is None else initial_state.float()
    return chunk_gla(q, k, v, g=log_gate, scale=scale, initial_state=h0, output_final_state=output_final_state)


def _gla_torch(q, k, v, log_gate, scale, chunk_size, initial_state):
    out_dtype, dtype, seq_len = q.dtype, compute_dtype(q.dtype), q.shape[1]
    q, k, v, g = (to_chunks(t, chunk_size, dtype) for t in (q, k, v, log_gate))  # [B, H, N, C, *]
    q = q * scale
    b = g.cumsum(-2)
    b_last = b[..., -1:, :]
    updates = (k * (b_last - b).exp()).transpose(-1, -2) @ v
    entering, final_state = scan_states(b_last.transpose(-1, -2).exp(), updates, initial_state)
    o = (q * b.exp()) @ entering + _within_chunks(q, k, v, b)
    return from_chunks(o, seq_len, out_dtype), final_state


def _within_chunks(q, k, v, b):
    """sum_{j <= i in the chunk} (q_i * exp(b_i - b_j)) . k_j  v_j for every position i."""
    chunk_size = q.shape[-2]
    sub = math.gcd(chunk_size, SUB_CHUNK)
    n_sub = chunk_size // sub
    qs, ks, vs, bs = (t.unflatten(-2, (n_sub, sub)) for t in (q, k, v, b))  # [B, H, N, n_sub, sub, *]

    # Earlier sub-chunks, through r = log decay just before each sub-chunk (0 before the first).
    r = F.pad(bs[..., :-1, -1, :], (0, 0, 1, 0)).unsqueeze(-2)  # [B, H, N, n_sub, 1, K]
    q_r = qs * (bs - r).exp()
    start = torch.arange(n_sub, device=q.device).unsqueeze(-1) * sub
    earlier = torch.arange(chunk_size, device=q.device) < start  # [n_sub, C]
    k_r = k.unsqueeze(-3) * (r - b.unsqueeze(-3)).masked_fill(~earlier.unsqueeze(-1), float("-inf")).exp()
    o = (q_r @ k_r.transpose(-1, -2)) @ v.unsqueeze(-3)

    # Same sub-chunk: pairwise decays.
    causal = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril().unsqueeze(-1)
    pair_decay = (bs.unsqueeze(-2) - bs.unsqueeze(-3)).masked_fill(~causal, float("-inf")).exp()
    scores = (qs.unsqueeze(-2) * ks.unsqueeze(-3) * pair_decay).sum(-1)
    return (o + scores @ vs).flatten(-3, -2)
