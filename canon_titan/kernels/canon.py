"""The Canon op: a causal depthwise convolution along the sequence, with optional bias, SiLU and
residual, on [batch, seq, channel] tensors.

    pre[t, c] = bias[c] + sum_j w[c, j] * x[t - (K-1) + j, c]      (zeros before the first token)
    out[t, c] = x[t, c] + act(pre[t, c])                           (act = SiLU or identity;
                                                                    the residual term is optional)

Two entry points: ``canon_conv`` (Canon-A/B/C, the linear models' short convolutions) and
``canon_swiglu``, Canon-D fused with the SwiGLU product that follows it:
``silu(canon(gate)) * canon(up)`` with one weight over ``[gate | up]``.

Backends:
- ``torch``: K shifted multiply-adds. Runs everywhere; under torch.compile Inductor fuses them.
- ``triton``: Triton kernels registered as torch custom ops (``canon_titan::canon_conv``,
  ``canon_titan::canon_swiglu``) with fake kernels and autograd, so a compiled block has no graph
  break. They read the [B, T, C] layout with any strides (no transposes, no copies). The backward
  saves only the op's inputs and recomputes the convolution; the fused SwiGLU op saves gate and up
  (what SwiGLU alone saves), not the Canon outputs. The forward kernels' blocks are autotuned, the
  backward kernels' fixed (their weight gradients are then bitwise reproducible). Runs on CUDA, or
  on CPU tensors when ``TRITON_INTERPRET=1`` is set before the import (Triton's interpreter: slow,
  for tests). ``python -m canon_titan.kernels.aot`` compiles the kernels for sm_90 without a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from canon_titan.kernels.backends import INTERPRETED, runs_cuda_kernel

TRITON_KERNEL_SIZES = (2, 3, 4)
"""Kernel sizes the Triton kernels are built for (every size a config allows)."""


# ----------------------------------------------------------------------------- torch backend


def _canon_torch(x, weight, bias, residual: bool, activation: bool):
    kernel, seq_len = weight.shape[-1], x.shape[1]
    padded = F.pad(x, (0, 0, kernel - 1, 0))
    y = x * weight[:, kernel - 1]
    for j in range(kernel - 1):
        y = y + padded[:, j : j + seq_len] * weight[:, j]
    if bias is not None:
        y = y + bias
    if activation:
        y = F.silu(y)
    return x + y if residual else y


# ----------------------------------------------------------------------------- Triton kernels

FORWARD_CONFIGS = [triton.Config({"BLOCK_T": t, "BLOCK_C": c}, num_warps=w)
                   for t, c, w in ((16, 64, 4), (16, 128, 4), (32, 128, 8), (16, 256, 8))]
"""The forward kernels' autotuning space: 1K to 4K elements per program, 40 to 128 registers on
sm_90, no spills (``python -m canon_titan.kernels.aot`` prints them). The tiles of 8K elements spill
or hold 200+ registers (a quarter of the warps per SM at most) and are left out."""

BACKWARD_BLOCKS = {"BLOCK_T": 16, "BLOCK_C": 32, "num_warps": 4}
"""The backward kernels' configuration where dz is dy (no recomputation), and the same where they
recompute the convolution on shifted rows (SiLU; the SwiGLU product needs both convolutions): on
sm_90, 63 registers here, 96 and 168 there (the per-tap accumulators), no spills. Measured on an H200
(2026-11-27, ``bench_canon.py --mode bwd_blocks``, batch 2 x 4096), 16x32/4w was the fastest of five
candidates for every call: Canon-A at 2048 channels 0.071 ms (16x64/4w, the blocks before, 0.094),
Canon-D 0.584 ms, Mamba2's b 0.293 ms. Fixed, not autotuned: the weight gradient sums over a chunk's
rows in an order the blocks decide, so fixed blocks give the same bits in every process and run, where
autotuning would pick by timing."""
RECOMPUTING_BACKWARD_BLOCKS = {"BLOCK_T": 16, "BLOCK_C": 32, "num_warps": 4}

CHUNK_T = 128
"""Rows of the sequence one backward program reduces the weight gradient over (a multiple of every
BLOCK_T): the partial sums hold batch * ceil(seq / CHUNK_T) rows."""


def _interpreter_blocks(seq_len: int, channels: int) -> dict:
    """Under the interpreter, whose cost is per program instance and per element of a block: the
    smallest power-of-two blocks that cover the tensor, up to 128 x 512."""
    return {"BLOCK_T": min(CHUNK_T, triton.next_power_of_2(seq_len)),
            "BLOCK_C": min(512, triton.next_power_of_2(channels))}


def _forward_blocks(channels: str, *flags: str):
    """Block sizes of a forward kernel: autotuned on a GPU (a forward element's value does not depend on
    them), with the timings kept on disk (Triton's cache) so that later runs skip the benchmark; under
    the interpreter, whose autotuning would need a GPU, ``_interpreter_blocks``."""
    if INTERPRETED:
        return triton.heuristics({name: lambda a, name=name: _interpreter_blocks(a["T"], a[channels])[name]
                                  for name in ("BLOCK_T", "BLOCK_C")})
    return triton.autotune(configs=FORWARD_CONFIGS, key=[channels, "K", *flags], cache_results=True)


def _backward_blocks(seq_len: int, channels: int, recomputes: bool) -> dict:
    if INTERPRETED:
        return _interpreter_blocks(seq_len, channels)
    return RECOMPUTING_BACKWARD_BLOCKS if recomputes else BACKWARD_BLOCKS


# Device functions take column offsets (``cols * stride``, int64) computed once per program: under
# the interpreter every device-function call and every block op costs Python time.


@triton.jit
def _load(ptr, rows, col_offsets, T, stride_t, col_mask):
    """A [rows, cols] tile in float32; zero outside 0 <= row < T (the causal padding)."""
    mask = ((rows >= 0) & (rows < T))[:, None] & col_mask[None, :]
    return tl.load(ptr + rows.to(tl.int64)[:, None] * stride_t + col_offsets[None, :], mask=mask,
                   other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, rows, col_offsets, T, stride_t, col_mask, value):
    mask = (rows < T)[:, None] & col_mask[None, :]
    tl.store(ptr + rows.to(tl.int64)[:, None] * stride_t + col_offsets[None, :], value.to(ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _row_stride(stride, ALIGNED: tl.constexpr):
    """A row stride, marked a multiple of 8 elements when the host checked it is: rows then start on
    16-byte boundaries and loads vectorise (Triton itself only recognises multiples of 16)."""
    if ALIGNED:
        stride = (stride // 8) * 8
    return stride


@triton.jit
def _load_input(x_ptr, rs_ptr, cs, rows, x_cols, col_mask, T, sx_t, srs_t, SCALED: tl.constexpr):
    """An input tile in float32: x, or ``x * row_scale[t] * col_scale[c]`` (a fused RMSNorm)."""
    in_seq = (rows >= 0) & (rows < T)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sx_t + x_cols[None, :], mask=in_seq[:, None] & col_mask[None, :],
                other=0.0).to(tl.float32)
    if SCALED:
        x = x * tl.load(rs_ptr + rows.to(tl.int64) * srs_t, mask=in_seq, other=0.0)[:, None] * cs[None, :]
    return x


@triton.jit
def _tap(w_ptr, w_cols, j, sw_k, col_mask):
    return tl.load(w_ptr + w_cols + j * sw_k, mask=col_mask, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _conv(x_ptr, w_ptr, b_ptr, rs_ptr, cs, rows, x_cols, w_cols, cols, col_mask, T, sx_t, srs_t, sw_k,
          K: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):
    """pre = bias + sum_j w[j] * input[t - (K-1) + j] on a tile, and the tile input[t] itself."""
    x = _load_input(x_ptr, rs_ptr, cs, rows - (K - 1), x_cols, col_mask, T, sx_t, srs_t, SCALED)
    pre = x * _tap(w_ptr, w_cols, 0, sw_k, col_mask)
    for j in tl.static_range(1, K):
        x = _load_input(x_ptr, rs_ptr, cs, rows - (K - 1 - j), x_cols, col_mask, T, sx_t, srs_t, SCALED)
        pre += x * _tap(w_ptr, w_cols, j, sw_k, col_mask)
    if HAS_BIAS:
        pre += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return pre, x


@triton.jit
def _finish(pre, x, RESIDUAL: tl.constexpr, SILU: tl.constexpr):
    out = pre
    if SILU:
        out = pre * tl.sigmoid(pre)
    if RESIDUAL:
        out += x
    return out


@triton.jit
def _silu_grad(pre):
    s = tl.sigmoid(pre)
    return s * (1.0 + pre * (1.0 - s))


@_forward_blocks("C", "HAS_BIAS", "RESIDUAL", "SILU")
@triton.jit
def _canon_fwd_kernel(x_ptr, w_ptr, b_ptr, rs_ptr, cs_ptr, y_ptr, T, C, sx_b, sx_t, sx_c, srs_b, srs_t,
                      sy_b, sy_t, sy_c, sw_c, sw_k,
                      K: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr,
                      SCALED: tl.constexpr, X_ALIGNED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    cols64 = cols.to(tl.int64)
    cs = tl.load(cs_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    pre, x = _conv(x_ptr + batch * sx_b, w_ptr, b_ptr, rs_ptr + batch * srs_b, cs, rows, cols64 * sx_c,
                   cols64 * sw_c, cols, col_mask, T, _row_stride(sx_t, X_ALIGNED), srs_t, sw_k, K, HAS_BIAS, SCALED)
    _store(y_ptr + batch * sy_b, rows, cols64 * sy_c, T, sy_t, col_mask, _finish(pre, x, RESIDUAL, SILU))


@_forward_blocks("H", "HAS_BIAS", "RESIDUAL", "SILU")
@triton.jit
def _canon_swiglu_fwd_kernel(g_ptr, u_ptr, w_ptr, b_ptr, y_ptr, T, H, sg_b, sg_t, sg_c, su_b, su_t, su_c,
                             sy_b, sy_t, sy_c, sw_c, sw_k,
                             K: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < H
    cols64 = cols.to(tl.int64)
    w_cols = cols64 * sw_c
    pre, x = _conv(g_ptr + batch * sg_b, w_ptr, b_ptr, w_ptr, w_cols, rows, cols64 * sg_c, w_cols, cols, col_mask,
                   T, sg_t, 0, sw_k, K, HAS_BIAS, False)
    gate = _finish(pre, x, RESIDUAL, SILU)
    pre, x = _conv(u_ptr + batch * su_b, w_ptr + H * sw_c, b_ptr + H, w_ptr, w_cols, rows, cols64 * su_c, w_cols,
                   cols, col_mask, T, su_t, 0, sw_k, K, HAS_BIAS, False)
    up = _finish(pre, x, RESIDUAL, SILU)
    _store(y_ptr + batch * sy_b, rows, cols64 * sy_c, T, sy_t, col_mask, gate * tl.sigmoid(gate) * up)


# The backward kernels finish dx in the program that computes dz, the gradient of ``pre``: dx[t] =
# sum_d w[K-1-d] * dz[t+d] needs dz on the K-1 rows after the tile too, which the program recomputes
# (from the inputs it reads anyway) instead of writing dz out and reading it back in another kernel.
# The weight gradient goes by the same shifts: dw[K-1-d] = sum_t dz[t+d] * input[t]. The shifts are
# unrolled (K is a constant), so a tile's loads issue together; the products dz * input are kept per
# tap and element over the whole chunk and summed across rows once at its end (a reduction across
# rows crosses warps: shared memory and a barrier each time).


@triton.jit
def _add_to_tap(a0, a1, a2, a3, value, TAP: tl.constexpr):
    """``value`` added to accumulator number TAP (a constant: no code for the others)."""
    if TAP == 0:
        a0 += value
    elif TAP == 1:
        a1 += value
    elif TAP == 2:
        a2 += value
    else:
        a3 += value
    return a0, a1, a2, a3


@triton.jit
def _taps_tile(a0, a1, a2, a3, K: tl.constexpr, K_PAD: tl.constexpr):
    """The per-tap accumulators summed over their rows, as one [K_PAD, BLOCK_C] tile (row j: tap j)."""
    taps = tl.arange(0, K_PAD)[:, None]
    out = tl.where(taps == 0, tl.sum(a0, axis=0)[None, :], 0.0)
    if K > 1:
        out += tl.where(taps == 1, tl.sum(a1, axis=0)[None, :], 0.0)
    if K > 2:
        out += tl.where(taps == 2, tl.sum(a2, axis=0)[None, :], 0.0)
    if K > 3:
        out += tl.where(taps == 3, tl.sum(a3, axis=0)[None, :], 0.0)
    return out


@triton.jit
def _store_partials(dw_ptr, db_ptr, dw_acc, db_acc, part, C, cols, col_mask, K: tl.constexpr, K_PAD: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
    """Partial sums of one program: dw at [part, c, j] (the weight's [C, K] layout), db at [part, c]."""
    taps = tl.arange(0, K_PAD)
    offsets = part * C * K + cols.to(tl.int64)[None, :] * K + taps[:, None]
    tl.store(dw_ptr + offsets, dw_acc, mask=(taps < K)[:, None] & col_mask[None, :])
    if HAS_BIAS:
        tl.store(db_ptr + part * C + cols, db_acc, mask=col_mask)


@triton.jit
def _canon_bwd_kernel(x_ptr, w_ptr, b_ptr, rs_ptr, cs_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr, T, C,
                      sx_b, sx_t, sx_c, srs_b, srs_t, sdy_b, sdy_t, sdy_c, sdx_b, sdx_t, sdx_c, sw_c, sw_k,
                      K: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                      SILU: tl.constexpr, SCALED: tl.constexpr, X_ALIGNED: tl.constexpr, CHUNK_T: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx (of the scaled input the convolution saw) and the weight/bias gradient partials over CHUNK_T
    rows. dz = dy, times SiLU's derivative at ``pre`` with SiLU."""
    batch = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    cols64 = cols.to(tl.int64)
    x_cols, dy_cols, dx_cols, w_cols = cols64 * sx_c, cols64 * sdy_c, cols64 * sdx_c, cols64 * sw_c
    sx_t = _row_stride(sx_t, X_ALIGNED)
    cs = tl.load(cs_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    x_ptr += batch * sx_b
    rs_ptr += batch * srs_b
    dy_ptr += batch * sdy_b
    a0 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    db_rows = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for t0 in range(0, CHUNK_T, BLOCK_T):
        rows = tl.program_id(0) * CHUNK_T + t0 + tl.arange(0, BLOCK_T)
        x = _load_input(x_ptr, rs_ptr, cs, rows, x_cols, col_mask, T, sx_t, srs_t, SCALED)
        dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for d in tl.static_range(K):
            dz = _load(dy_ptr, rows + d, dy_cols, T, sdy_t, col_mask)
            if RESIDUAL and d == 0:
                dx += dz
            if SILU:
                pre, _ = _conv(x_ptr, w_ptr, b_ptr, rs_ptr, cs, rows + d, x_cols, w_cols, cols, col_mask, T, sx_t,
                               srs_t, sw_k, K, HAS_BIAS, SCALED)
                dz *= _silu_grad(pre)
            dx += _tap(w_ptr, w_cols, K - 1 - d, sw_k, col_mask) * dz
            a0, a1, a2, a3 = _add_to_tap(a0, a1, a2, a3, dz * x, K - 1 - d)
            if HAS_BIAS and d == 0:
                db_rows += dz
        _store(dx_ptr + batch * sdx_b, rows, dx_cols, T, sdx_t, col_mask, dx)
    part = batch * tl.num_programs(0) + tl.program_id(0)
    _store_partials(dw_ptr, db_ptr, _taps_tile(a0, a1, a2, a3, K, K_PAD), tl.sum(db_rows, axis=0), part, C, cols,
                    col_mask, K, K_PAD, HAS_BIAS)


@triton.jit
def _canon_swiglu_bwd_kernel(g_ptr, u_ptr, w_ptr, b_ptr, dy_ptr, dg_ptr, du_ptr, dw_ptr, db_ptr, T, H,
                             sg_b, sg_t, sg_c, su_b, su_t, su_c, sdy_b, sdy_t, sdy_c, sdx_b, sdx_t, sdx_c, sw_c, sw_k,
                             K: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                             SILU: tl.constexpr, CHUNK_T: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_C: tl.constexpr):
    """Gradients of gate and up (dg, du: same strides) and the weight/bias partials over CHUNK_T rows
    ([parts, 2H, K]). The Canon outputs' gradients (of ``silu(g) * u``) are d_gate and d_up; dz is
    theirs times SiLU's derivative at ``pre`` with SiLU."""
    batch = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < H
    cols64 = cols.to(tl.int64)
    g_cols, u_cols, dy_cols, dx_cols, w_cols = cols64 * sg_c, cols64 * su_c, cols64 * sdy_c, cols64 * sdx_c, \
        cols64 * sw_c
    wu_ptr, bu_ptr = w_ptr + H * sw_c, b_ptr + H
    g_ptr += batch * sg_b
    u_ptr += batch * su_b
    dy_ptr += batch * sdy_b
    g0 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    g1 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    g2 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    g3 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    u0 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    u1 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    u2 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    u3 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    db_g = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    db_u = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for t0 in range(0, CHUNK_T, BLOCK_T):
        rows = tl.program_id(0) * CHUNK_T + t0 + tl.arange(0, BLOCK_T)
        g = _load(g_ptr, rows, g_cols, T, sg_t, col_mask)
        u = _load(u_ptr, rows, u_cols, T, su_t, col_mask)
        dx_g = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        dx_u = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for d in tl.static_range(K):
            pre_g, x = _conv(g_ptr, w_ptr, b_ptr, w_ptr, w_cols, rows + d, g_cols, w_cols, cols, col_mask, T, sg_t, 0,
                             sw_k, K, HAS_BIAS, False)
            gate = _finish(pre_g, x, RESIDUAL, SILU)
            pre_u, x = _conv(u_ptr, wu_ptr, bu_ptr, w_ptr, w_cols, rows + d, u_cols, w_cols, cols, col_mask, T, su_t,
                             0, sw_k, K, HAS_BIAS, False)
            up = _finish(pre_u, x, RESIDUAL, SILU)
            dy = _load(dy_ptr, rows + d, dy_cols, T, sdy_t, col_mask)
            sig = tl.sigmoid(gate)
            dz_g = dy * up * sig * (1.0 + gate * (1.0 - sig))
            dz_u = dy * gate * sig
            if RESIDUAL and d == 0:
                dx_g += dz_g
                dx_u += dz_u
            if SILU:
                dz_g *= _silu_grad(pre_g)
                dz_u *= _silu_grad(pre_u)
            dx_g += _tap(w_ptr, w_cols, K - 1 - d, sw_k, col_mask) * dz_g
            dx_u += _tap(wu_ptr, w_cols, K - 1 - d, sw_k, col_mask) * dz_u
            g0, g1, g2, g3 = _add_to_tap(g0, g1, g2, g3, dz_g * g, K - 1 - d)
            u0, u1, u2, u3 = _add_to_tap(u0, u1, u2, u3, dz_u * u, K - 1 - d)
            if HAS_BIAS and d == 0:
                db_g += dz_g
                db_u += dz_u
        _store(dg_ptr + batch * sdx_b, rows, dx_cols, T, sdx_t, col_mask, dx_g)
        _store(du_ptr + batch * sdx_b, rows, dx_cols, T, sdx_t, col_mask, dx_u)
    part = batch * tl.num_programs(0) + tl.program_id(0)
    _store_partials(dw_ptr, db_ptr, _taps_tile(g0, g1, g2, g3, K, K_PAD), tl.sum(db_g, axis=0), part, 2 * H, cols,
                    col_mask, K, K_PAD, HAS_BIAS)
    _store_partials(dw_ptr, db_ptr, _taps_tile(u0, u1, u2, u3, K, K_PAD), tl.sum(db_u, axis=0), part, 2 * H, cols + H,
                    col_mask, K, K_PAD, HAS_BIAS)


def _grid(batch: int, seq_len: int, channels: int, rows_per_program: int | None = None):
    return lambda meta: (triton.cdiv(seq_len, rows_per_program or meta["BLOCK_T"]),
                         triton.cdiv(channels, meta["BLOCK_C"]), batch)


def _partials(batch: int, seq_len: int, kernel: int, channels: int, like: torch.Tensor, bias: bool):
    """fp32 partial sums of dw [parts, channels, K] and, with a bias, db [parts, channels]; without one
    db's pointer is dw's, never written."""
    parts = batch * triton.cdiv(seq_len, CHUNK_T)
    dw = torch.empty(parts, channels, kernel, dtype=torch.float32, device=like.device)
    return dw, torch.empty(parts, channels, dtype=torch.float32, device=like.device) if bias else dw


def _weight_grads(partial_dw: torch.Tensor, partial_db: torch.Tensor, weight: torch.Tensor, bias):
    dw = partial_dw.sum(0).to(weight.dtype)
    db = partial_db.sum(0).to(bias.dtype) if bias is not None else weight.new_empty(0)
    return dw, db


def _bias_ptr(bias, weight):
    # Never read when HAS_BIAS is false; any tensor on the device serves as the pointer. The
    # kernels read the bias with unit stride (a slice of a [C] parameter has it).
    return bias.contiguous() if bias is not None else weight


def _rows_aligned(x: torch.Tensor) -> bool:
    return x.stride(1) % 8 == 0


def _scale_args(row_scale, col_scale, weight) -> tuple:
    """Kernel arguments of the optional input scaling: pointers and row-scale strides."""
    if row_scale is None:
        return weight, weight, 0, 0
    return row_scale, col_scale.contiguous(), *row_scale.stride()


# ----------------------------------------------------------------------------- launches


def conv_forward(x, weight, bias, row_scale, col_scale, residual: bool, activation: bool) -> torch.Tensor:
    batch, seq_len, channels = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rs, cs, srs_b, srs_t = _scale_args(row_scale, col_scale, weight)
    _canon_fwd_kernel[_grid(batch, seq_len, channels)](
        x, weight, _bias_ptr(bias, weight), rs, cs, y, seq_len, channels, *x.stride(), srs_b, srs_t, *y.stride(),
        *weight.stride(), K=weight.shape[1], HAS_BIAS=bias is not None, RESIDUAL=residual, SILU=activation,
        SCALED=row_scale is not None, X_ALIGNED=_rows_aligned(x))
    return y


def conv_backward(dy, x, weight, bias, row_scale, col_scale, residual: bool, activation: bool):
    """Gradients of the convolution's input (after scaling), weight and bias (empty without one)."""
    batch, seq_len, channels = x.shape
    kernel = weight.shape[1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    partial_dw, partial_db = _partials(batch, seq_len, kernel, channels, x, bias is not None)
    rs, cs, srs_b, srs_t = _scale_args(row_scale, col_scale, weight)
    _canon_bwd_kernel[_grid(batch, seq_len, channels, CHUNK_T)](
        x, weight, _bias_ptr(bias, weight), rs, cs, dy, dx, partial_dw, partial_db, seq_len, channels,
        *x.stride(), srs_b, srs_t, *dy.stride(), *dx.stride(), *weight.stride(),
        K=kernel, K_PAD=triton.next_power_of_2(kernel), HAS_BIAS=bias is not None, RESIDUAL=residual,
        SILU=activation, SCALED=row_scale is not None, X_ALIGNED=_rows_aligned(x), CHUNK_T=CHUNK_T,
        **_backward_blocks(seq_len, channels, recomputes=activation))
    return (dx, *_weight_grads(partial_dw, partial_db, weight, bias))


def swiglu_forward(gate, up, weight, bias, residual: bool, activation: bool) -> torch.Tensor:
    batch, seq_len, hidden = gate.shape
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _canon_swiglu_fwd_kernel[_grid(batch, seq_len, hidden)](
        gate, up, weight, _bias_ptr(bias, weight), y, seq_len, hidden, *gate.stride(), *up.stride(), *y.stride(),
        *weight.stride(), K=weight.shape[1], HAS_BIAS=bias is not None, RESIDUAL=residual, SILU=activation)
    return y


def swiglu_backward(dy, gate, up, weight, bias, residual: bool, activation: bool):
    """Gradients of gate, up, the weight and the bias (empty without one)."""
    batch, seq_len, hidden = gate.shape
    kernel = weight.shape[1]
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    partial_dw, partial_db = _partials(batch, seq_len, kernel, 2 * hidden, gate, bias is not None)
    _canon_swiglu_bwd_kernel[_grid(batch, seq_len, hidden, CHUNK_T)](
        gate, up, weight, _bias_ptr(bias, weight), dy, d_gate, d_up, partial_dw, partial_db, seq_len, hidden,
        *gate.stride(), *up.stride(), *dy.stride(), *d_gate.stride(), *weight.stride(),
        K=kernel, K_PAD=triton.next_power_of_2(kernel), HAS_BIAS=bias is not None, RESIDUAL=residual,
        SILU=activation, CHUNK_T=CHUNK_T, **_backward_blocks(seq_len, hidden, recomputes=True))
    return (d_gate, d_up, *_weight_grads(partial_dw, partial_db, weight, bias))


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("canon_titan::canon_conv", mutates_args=())
def _canon_conv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_scale: torch.Tensor | None,
                   col_scale: torch.Tensor | None, residual: bool, activation: bool) -> torch.Tensor:
    return conv_forward(x, weight, bias, row_scale, col_scale, residual, activation)


@_canon_conv_op.register_fake
def _(x, weight, bias, row_scale, col_scale, residual, activation):
    return x.new_empty(x.shape)


@torch.library.custom_op("canon_titan::canon_conv_backward", mutates_args=())
def _canon_conv_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            row_scale: torch.Tensor | None, col_scale: torch.Tensor | None, residual: bool,
                            activation: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return conv_backward(dy, x, weight, bias, row_scale, col_scale, residual, activation)


@_canon_conv_backward_op.register_fake
def _(dy, x, weight, bias, row_scale, col_scale, residual, activation):
    db = bias.new_empty(bias.shape) if bias is not None else weight.new_empty(0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _canon_conv_setup(ctx, inputs, output):
    x, weight, bias, row_scale, col_scale, ctx.residual, ctx.activation = inputs
    ctx.save_for_backward(x, weight, bias, row_scale, col_scale)


def _canon_conv_grad(ctx, dy):
    x, weight, bias, row_scale, col_scale = ctx.saved_tensors
    d_input, dw, db = torch.ops.canon_titan.canon_conv_backward(dy, x, weight, bias, row_scale, col_scale,
                                                                ctx.residual, ctx.activation)
    db = db if bias is not None else None
    if row_scale is None:
        return d_input, dw, db, None, None, None, None
    # input = x * row_scale * col_scale, in float32 (traced: Inductor fuses these into one pass).
    d_input, xf, cs = d_input.float(), x.float(), col_scale.float()
    dx = (d_input * row_scale.unsqueeze(-1) * cs).to(x.dtype)
    d_row = (d_input * xf * cs).sum(-1).to(row_scale.dtype)
    d_col = (d_input * xf * row_scale.unsqueeze(-1)).sum((0, 1)).to(col_scale.dtype)
    return dx, dw, db, d_row, d_col, None, None


_canon_conv_op.register_autograd(_canon_conv_grad, setup_context=_canon_conv_setup)


@torch.library.custom_op("canon_titan::canon_swiglu", mutates_args=())
def _canon_swiglu_op(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     residual: bool, activation: bool) -> torch.Tensor:
    return swiglu_forward(gate, up, weight, bias, residual, activation)


@_canon_swiglu_op.register_fake
def _(gate, up, weight, bias, residual, activation):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("canon_titan::canon_swiglu_backward", mutates_args=())
def _canon_swiglu_backward_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None, residual: bool, activation: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_backward(dy, gate, up, weight, bias, residual, activation)


@_canon_swiglu_backward_op.register_fake
def _(dy, gate, up, weight, bias, residual, activation):
    db = bias.new_empty(bias.shape) if bias is not None else weight.new_empty(0)
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape), weight.new_empty(weight.shape), db


def _canon_swiglu_setup(ctx, inputs, output):
    gate, up, weight, bias, ctx.residual, ctx.activation = inputs
    ctx.save_for_backward(gate, up, weight, bias)


def _canon_swiglu_grad(ctx, dy):
    gate, up, weight, bias = ctx.saved_tensors
    d_gate, d_up, dw, db = torch.ops.canon_titan.canon_swiglu_backward(dy, gate, up, weight, bias, ctx.residual,
                                                                       ctx.activation)
    return d_gate, d_up, dw, db if bias is not None else None, None, None


_canon_swiglu_op.register_autograd(_canon_swiglu_grad, setup_context=_canon_swiglu_setup)


# ----------------------------------------------------------------------------- entry points


def _use_triton(backend: str, x: torch.Tensor, kernel_size: int) -> bool:
    return kernel_size in TRITON_KERNEL_SIZES and runs_cuda_kernel(backend, x)


def canon_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               row_scale: torch.Tensor | None = None, col_scale: torch.Tensor | None = None, residual: bool = True,
               activation: bool = False, backend: str = "torch") -> torch.Tensor:
    """x [B, T, C], weight [C, K] (index K-1 on the current token), bias [C] or None.

    With ``row_scale`` [B, T] and ``col_scale`` [C] the layer's input is ``x * row_scale * col_scale``
    computed in float32 (an RMSNorm fused in: its inverse RMS and weight): the torch backend rounds
    it to x's dtype as RMSNorm does, the Triton kernels keep it in float32 and never store it.
    """
    if (row_scale is None) != (col_scale is None):
        raise ValueError("canon_conv: row_scale and col_scale go together")
    if _use_triton(backend, x, weight.shape[-1]):
        return torch.ops.canon_titan.canon_conv(x, weight, bias, row_scale, col_scale, residual, activation)
    if row_scale is not None:
        x = (x.float() * row_scale.unsqueeze(-1) * col_scale.float()).type_as(x)
    return _canon_torch(x, weight, bias, residual, activation)


def canon_swiglu(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 residual: bool = True, activation: bool = False, backend: str = "torch") -> torch.Tensor:
    """``silu(canon(gate)) * canon(up)`` with weight [2H, K] over [gate | up] (gate, up: [B, T, H])."""
    if _use_triton(backend, gate, weight.shape[-1]):
        return torch.ops.canon_titan.canon_swiglu(gate, up, weight, bias, residual, activation)
    hidden = gate.shape[-1]
    w_gate, w_up = weight.split(hidden)
    b_gate, b_up = bias.split(hidden) if bias is not None else (None, None)
    gate = _canon_torch(gate, w_gate, b_gate, residual, activation)
    return F.silu(gate) * _canon_torch(up, w_up, b_up, residual, activation)
