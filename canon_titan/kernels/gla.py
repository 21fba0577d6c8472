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

import functools
import math

import torch
import torch.nn.functional as F

import triton

from canon_titan.kernels.backends import (compute_dtype, from_chunks, prepare_kernels, runs_cuda_kernel, scan_states,
                                          to_chunks)

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
    if runs_cuda_kernel(backend, q):
        # fla keeps the state in float32.
        h0 = None if initial_state is None else initial_state.float()
        o, final_state, _ = torch.ops.canon_titan.fla_chunk_gla(q, k, v, log_gate, h0, scale, output_final_state)
        return o, final_state if output_final_state else None
    o, final_state = _gla_torch(q, k, v, log_gate, scale, chunk_size, initial_state)
    return o, final_state if output_final_state else None


def _fla_chunk_size(seq_len: int) -> int:
    """The block length ChunkGLAFunction uses."""
    return min(64, max(16, triton.next_power_of_2(seq_len)))


@functools.cache
def _fla_halves():
    """fla's forward and backward halves of ``ChunkGLAFunction``, each under fla's ``input_guard`` (its kernels
    assume contiguous [B, T, H, K] and launch on the current device). Guarded once: ``input_guard`` reads the
    function's signature each time it wraps one, a few hundred Python calls on every op call."""
    prepare_kernels("fla")
    from fla.ops.gla.chunk import chunk_gla_bwd, chunk_gla_fwd
    from fla.utils import input_guard

    return input_guard(chunk_gla_fwd), input_guard(chunk_gla_bwd)


@functools.lru_cache(maxsize=8)
def _unwritten(seq_len: int, chunk_size: int, device: torch.device) -> torch.Tensor:
    """[T, 1, chunk]: where fla leaves A unwritten (key j after query t within the chunk), made once per shape."""
    position = torch.arange(seq_len, device=device) % chunk_size
    return torch.arange(chunk_size, device=device) > position[:, None, None]


@torch.library.custom_op("canon_titan::fla_chunk_gla", mutates_args=())
def _fla_chunk_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   initial_state: torch.Tensor | None, scale: float, output_final_state: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """o, the final state (empty unless asked for) and fla's intra-chunk scores A (for the backward)."""
    chunk_size = _fla_chunk_size(q.shape[1])
    _, A, _, final_state, o = _fla_halves()[0](
        q=q, k=k, v=v, g=g, g_cumsum=None, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, chunk_size=chunk_size)
    # fla writes A [B, T, H, chunk] only where key j <= query t within the chunk; an op's outputs
    # must not carry uninitialised memory (compiled and eager runs would differ there).
    A.masked_fill_(_unwritten(q.shape[1], chunk_size, A.device), 0.0)
    return o.to(q.dtype), final_state if output_final_state else q.new_empty(0, dtype=torch.float32), A


@_fla_chunk_gla.register_fake
def _(q, k, v, g, initial_state, scale, output_final_state):
    batch, seq_len, heads, dk = q.shape
    final = (q.new_empty(batch, heads, dk, v.shape[-1], dtype=torch.float32) if output_final_state
             else q.new_empty(0, dtype=torch.float32))
    A = q.new_empty(batch, seq_len, heads, _fla_chunk_size(seq_len), dtype=torch.float32)
    return q.new_empty(*q.shape[:3], v.shape[-1]), final, A


@torch.library.custom_op("canon_titan::fla_chunk_gla_backward", mutates_args=())
def _fla_chunk_gla_backward(do: torch.Tensor, d_final: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, g: torch.Tensor, initial_state: torch.Tensor | None, A: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dg, dh0 = _fla_halves()[1](
        q=q, k=k, v=v, g=g, g_cumsum=None, scale=scale, initial_state=initial_state, h=None, A=A, do=do, dht=d_final,
        chunk_size=_fla_chunk_size(q.shape[1]))
    dh0 = dh0 if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dh0


@_fla_chunk_gla_backward.register_fake
def _(do, d_final, q, k, v, g, initial_state, A, scale):
    dh0 = initial_state.new_empty(initial_state.shape) if initial_state is not None else q.new_empty(0,
                                                                                                     dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape), dh0


def _fla_chunk_gla_setup(ctx, inputs, output):
    q, k, v, g, initial_state, ctx.scale, ctx.output_final_state = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(q, k, v, g, initial_state, output[2])


def _fla_chunk_gla_grad(ctx, do, d_final, _dA):
    q, k, v, g, initial_state, A = ctx.saved_tensors
    d_final = d_final if ctx.output_final_state else None
    dq, dk, dv, dg, dh0 = torch.ops.canon_titan.fla_chunk_gla_backward(do, d_final, q, k, v, g, initial_state, A,
                                                                       ctx.scale)
    return dq, dk, dv, dg, dh0 if initial_state is not None else None, None, None


_fla_chunk_gla.register_autograd(_fla_chunk_gla_grad, setup_context=_fla_chunk_gla_setup)


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
