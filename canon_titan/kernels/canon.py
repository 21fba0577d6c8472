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
  (what SwiGLU alone saves), not the Canon outputs. Runs on CUDA, or on CPU tensors when
  ``TRITON_INTERPRET=1`` is set before the import (Triton's interpreter: slow, for tests).
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


def _blocks(channels: str, *flags: str):
    """Block sizes: autotuned on a GPU; under the interpreter, whose cost is per program instance
    and per element of the block, the smallest power-of-two blocks that cover the tensor (up to
    128 x 512), and no autotuning (its benchmarking needs a GPU)."""
    if INTERPRETED:
        return triton.heuristics({"BLOCK_T": lambda a: min(128, triton.next_power_of_2(a["T"])),
                                  "BLOCK_C": lambda a: min(512, triton.next_power_of_2(a[channels]))})
    configs = [triton.Config({"BLOCK_T": t, "BLOCK_C": c}, num_warps=w) for t in (16, 32) for c in (64, 128, 256)
               for w in (4, 8)]
    return triton.autotune(configs=configs, key=[channels, "K", *flags])


# Rows of the sequence one backward program reduces the weight gradient over (a multiple of every
# BLOCK_T): the partial sums then hold batch * ceil(seq / CHUNK_T) rows.
_CHUNK_T = 128


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
def _load_input(x_ptr, rs_ptr, cs, rows, x_cols, col_mask, T, sx_t, srs_t, SCALED: tl.constexpr):
    """An input tile in float32: x, or ``x * row_scale[t] * col_scale[c]`` (a fused RMSNorm)."""
    in_seq = (rows >= 0) & (rows < T)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sx_t + x_cols[None, :], mask=in_seq[:, None] & col_mask[None, :],
                other=0.0).to(tl.float32)
    if SCALED:
        x = x * tl.load(rs_ptr + rows.to(tl.int64) * srs_t, mask=in_seq, other=0.0)[:, None] * cs[None, :]
    return x


@triton.jit
def _conv(x_ptr, w_ptr, b_ptr, rs_ptr, cs, rows, x_cols, w_cols, cols, col_mask, T, sx_t, srs_t, sw_k,
          K: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):
    """pre = bias + sum_j w[j] * input[t - (K-1) + j] on a tile, and the tile input[t] itself."""
    x = _load_input(x_ptr, rs_ptr, cs, rows - (K - 1), x_cols, col_mask, T, sx_t, srs_t, SCALED)
    pre = x * tl.load(w_ptr + w_cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(1, K):
        x = _load_input(x_ptr, rs_ptr, cs, rows - (K - 1 - j), x_cols, col_mask, T, sx_t, srs_t, SCALED)
        pre += x * tl.load(w_ptr + w_cols + j * sw_k, mask=col_mask, other=0.0).to(tl.float32)[None, :]
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


@_blocks("C", "HAS_BIAS", "RESIDUAL", "SILU")
@triton.jit
def _canon_fwd_kernel(x_ptr, w_ptr, b_ptr, rs_ptr, cs_ptr, y_ptr, T, C, sx_b, sx_t, sx_c, srs_b, srs_t,
                      sy_b, sy_t, sy_c, sw_c, sw_k,
                      K: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr,
                      SCALED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    cols64 = cols.to(tl.int64)
    cs = tl.load(cs_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    pre, x = _conv(x_ptr + batch * sx_b, w_ptr, b_ptr, rs_ptr + batch * srs_b, cs, rows, cols64 * sx_c,
                   cols64 * sw_c, cols, col_mask, T, sx_t, srs_t, sw_k, K, HAS_BIAS, SCALED)
    _store(y_ptr + batch * sy_b, rows, cols64 * sy_c, T, sy_t, col_mask, _finish(pre, x, RESIDUAL, SILU))


@_blocks("H", "HAS_BIAS", "RESIDUAL", "SILU")
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


@triton.jit
def _accumulate_weight_grads(dw_acc, db_acc, dz, x_ptr, rs_ptr, cs, rows, x_cols, col_mask, T, sx_t, srs_t,
                             K: tl.constexpr, K_PAD: tl.constexpr, SCALED: tl.constexpr):
    """dw[j] += sum_t dz[t] * input[t - (K-1) + j] and db += sum_t dz[t] over the tile's rows."""
    taps = tl.arange(0, K_PAD)[:, None]
    for j in tl.static_range(K):
        x = _load_input(x_ptr, rs_ptr, cs, rows - (K - 1 - j), x_cols, col_mask, T, sx_t, srs_t, SCALED)
        dw_acc += tl.where(taps == j, tl.sum(dz * x, axis=0)[None, :], 0.0)
    return dw_acc, db_acc + tl.sum(dz, axis=0)


@triton.jit
def _transposed_conv(acc, dz_ptr, w_ptr, rows, z_cols, w_cols, col_mask, T, sz_t, sw_k, K: tl.constexpr):
    """acc + sum_d w[K-1-d] * dz[t + d]: the gradient of the convolution's input."""
    for d in tl.static_range(K):
        w = tl.load(w_ptr + w_cols + (K - 1 - d) * sw_k, mask=col_mask, other=0.0).to(tl.float32)
        acc += w[None, :] * _load(dz_ptr, rows + d, z_cols, T, sz_t, col_mask)
    return acc


@triton.jit
def _store_partials(dw_ptr, db_ptr, dw_acc, db_acc, part, C, cols, col_mask, K: tl.constexpr, K_PAD: tl.constexpr):
    taps = tl.arange(0, K_PAD)
    offsets = part * K * C + taps[:, None] * C + cols[None, :]
    tl.store(dw_ptr + offsets, dw_acc, mask=(taps < K)[:, None] & col_mask[None, :])
    tl.store(db_ptr + part * C + cols, db_acc, mask=col_mask)


@_blocks("C", "HAS_BIAS", "RESIDUAL", "SILU")
@triton.jit
def _canon_bwd_kernel(x_ptr, w_ptr, b_ptr, rs_ptr, cs_ptr, dy_ptr, dz_ptr, dx_ptr, dw_ptr, db_ptr, T, C,
                      sx_b, sx_t, sx_c, srs_b, srs_t, sdy_b, sdy_t, sdy_c, sdx_b, sdx_t, sdx_c, sw_c, sw_k,
                      K: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                      SILU: tl.constexpr, SCALED: tl.constexpr, CHUNK_T: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """Weight/bias gradient partials over CHUNK_T rows. Without SiLU the gradient of ``pre`` is dy
    itself, so the input gradient is finished here too; with SiLU it is written to dz (laid out as
    dx) for ``_canon_dx_kernel``: dx needs it at later rows, which other programs compute. dx is the
    gradient of the (scaled) input the convolution saw."""
    batch = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    cols64 = cols.to(tl.int64)
    x_cols, dy_cols, dx_cols, w_cols = cols64 * sx_c, cols64 * sdy_c, cols64 * sdx_c, cols64 * sw_c
    cs = tl.load(cs_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    x_ptr += batch * sx_b
    rs_ptr += batch * srs_b
    dy_ptr += batch * sdy_b
    dw_acc = tl.zeros([K_PAD, BLOCK_C], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for t0 in range(0, CHUNK_T, BLOCK_T):
        rows = tl.program_id(0) * CHUNK_T + t0 + tl.arange(0, BLOCK_T)
        dz = _load(dy_ptr, rows, dy_cols, T, sdy_t, col_mask)
        if SILU:
            pre, x = _conv(x_ptr, w_ptr, b_ptr, rs_ptr, cs, rows, x_cols, w_cols, cols, col_mask, T, sx_t, srs_t,
                           sw_k, K, HAS_BIAS, SCALED)
            dz *= _silu_grad(pre)
            _store(dz_ptr + batch * sdx_b, rows, dx_cols, T, sdx_t, col_mask, dz)
        else:
            dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            if RESIDUAL:
                dx = dz
            dx = _transposed_conv(dx, dy_ptr, w_ptr, rows, dy_cols, w_cols, col_mask, T, sdy_t, sw_k, K)
            _store(dx_ptr + batch * sdx_b, rows, dx_cols, T, sdx_t, col_mask, dx)
        dw_acc, db_acc = _accumulate_weight_grads(dw_acc, db_acc, dz, x_ptr, rs_ptr, cs, rows, x_cols, col_mask, T,
                                                  sx_t, srs_t, K, K_PAD, SCALED)
    part = batch * tl.num_programs(0) + tl.program_id(0)
    _store_partials(dw_ptr, db_ptr, dw_acc, db_acc, part, C, cols, col_mask, K, K_PAD)


@_blocks("C", "HAS_RES")
@triton.jit
def _canon_dx_kernel(dz_ptr, res_ptr, w_ptr, dx_ptr, T, C, sz_b, sz_t, sz_c, sr_b, sr_t, sr_c,
                     sdx_b, sdx_t, sdx_c, sw_c, sw_k,
                     K: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx = res + sum_d w[K-1-d] * dz[t + d]."""
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    cols64 = cols.to(tl.int64)
    dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_RES:
        dx = _load(res_ptr + batch * sr_b, rows, cols64 * sr_c, T, sr_t, col_mask)
    dx = _transposed_conv(dx, dz_ptr + batch * sz_b, w_ptr, rows, cols64 * sz_c, cols64 * sw_c, col_mask, T, sz_t,
                          sw_k, K)
    _store(dx_ptr + batch * sdx_b, rows, cols64 * sdx_c, T, sdx_t, col_mask, dx)


@_blocks("H", "HAS_BIAS", "RESIDUAL", "SILU")
@triton.jit
def _canon_swiglu_bwd_kernel(g_ptr, u_ptr, w_ptr, b_ptr, dy_ptr, dz_ptr, res_ptr, dw_ptr, db_ptr, T, H,
                             sg_b, sg_t, sg_c, su_b, su_t, su_c, sdy_b, sdy_t, sdy_c, sw_c, sw_k,
                             K: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                             SILU: tl.constexpr, CHUNK_T: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_C: tl.constexpr):
    """Gradients of both convolutions' ``pre`` (to dz, [2, B, T, H] contiguous), of the Canon
    outputs when residual and SiLU make them differ (to res, same layout), and weight/bias partials
    over CHUNK_T rows ([parts, K, 2H])."""
    batch = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < H
    cols64 = cols.to(tl.int64)
    g_cols, u_cols, dy_cols, w_cols = cols64 * sg_c, cols64 * su_c, cols64 * sdy_c, cols64 * sw_c
    g_ptr += batch * sg_b
    u_ptr += batch * su_b
    dy_ptr += batch * sdy_b
    # dz and res: [2, B, T, H] contiguous; the up half starts one [B, T, H] block later.
    own_rows = batch * T * H
    other_half = tl.num_programs(2).to(tl.int64) * T * H
    dw_g = tl.zeros([K_PAD, BLOCK_C], dtype=tl.float32)
    db_g = tl.zeros([BLOCK_C], dtype=tl.float32)
    dw_u = tl.zeros([K_PAD, BLOCK_C], dtype=tl.float32)
    db_u = tl.zeros([BLOCK_C], dtype=tl.float32)
    for t0 in range(0, CHUNK_T, BLOCK_T):
        rows = tl.program_id(0) * CHUNK_T + t0 + tl.arange(0, BLOCK_T)
        pre_g, x = _conv(g_ptr, w_ptr, b_ptr, w_ptr, w_cols, rows, g_cols, w_cols, cols, col_mask, T, sg_t, 0, sw_k,
                         K, HAS_BIAS, False)
        gate = _finish(pre_g, x, RESIDUAL, SILU)
        pre_u, x = _conv(u_ptr, w_ptr + H * sw_c, b_ptr + H, w_ptr, w_cols, rows, u_cols, w_cols, cols, col_mask, T,
                         su_t, 0, sw_k, K, HAS_BIAS, False)
        up = _finish(pre_u, x, RESIDUAL, SILU)
        dy = _load(dy_ptr, rows, dy_cols, T, sdy_t, col_mask)
        sig = tl.sigmoid(gate)
        d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = dy * gate * sig
        dz_g, dz_u = d_gate, d_up
        if SILU:
            dz_g = d_gate * _silu_grad(pre_g)
            dz_u = d_up * _silu_grad(pre_u)
            if RESIDUAL:
                _store(res_ptr + own_rows, rows, cols64, T, H, col_mask, d_gate)
                _store(res_ptr + other_half + own_rows, rows, cols64, T, H, col_mask, d_up)
        _store(dz_ptr + own_rows, rows, cols64, T, H, col_mask, dz_g)
        _store(dz_ptr + other_half + own_rows, rows, cols64, T, H, col_mask, dz_u)
        dw_g, db_g = _accumulate_weight_grads(dw_g, db_g, dz_g, g_ptr, w_ptr, w_cols, rows, g_cols, col_mask, T, sg_t,
                                              0, K, K_PAD, False)
        dw_u, db_u = _accumulate_weight_grads(dw_u, db_u, dz_u, u_ptr, w_ptr, w_cols, rows, u_cols, col_mask, T, su_t,
                                              0, K, K_PAD, False)
    part = batch * tl.num_programs(0) + tl.program_id(0)
    _store_partials(dw_ptr, db_ptr, dw_g, db_g, part, 2 * H, cols, col_mask, K, K_PAD)
    _store_partials(dw_ptr, db_ptr, dw_u, db_u, part, 2 * H, cols + H, col_mask, K, K_PAD)


def _grid(batch: int, seq_len: int, channels: int, rows_per_program: int | None = None):
    return lambda meta: (triton.cdiv(seq_len, rows_per_program or meta["BLOCK_T"]),
                         triton.cdiv(channels, meta["BLOCK_C"]), batch)


def _weight_grads(partial_dw: torch.Tensor, partial_db: torch.Tensor, weight: torch.Tensor, bias):
    dw = partial_dw.sum(0).t().contiguous().to(weight.dtype)
    db = partial_db.sum(0).to(bias.dtype) if bias is not None else weight.new_empty(0)
    return dw, db


def _partials(batch: int, seq_len: int, kernel: int, channels: int, like: torch.Tensor):
    parts = batch * triton.cdiv(seq_len, _CHUNK_T)
    return (torch.empty(parts, kernel, channels, dtype=torch.float32, device=like.device),
            torch.empty(parts, channels, dtype=torch.float32, device=like.device))


def _bias_ptr(bias, weight):
    # Never read when HAS_BIAS is false; any tensor on the device serves as the pointer. The
    # kernels read the bias with unit stride (a slice of a [C] parameter has it).
    return bias.contiguous() if bias is not None else weight


# ----------------------------------------------------------------------------- custom ops


def _scale_args(row_scale, col_scale, weight) -> tuple:
    """Kernel arguments of the optional input scaling: pointers and row-scale strides."""
    if row_scale is None:
        return weight, weight, 0, 0
    return row_scale, col_scale.contiguous(), *row_scale.stride()


@torch.library.custom_op("canon_titan::canon_conv", mutates_args=())
def _canon_conv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_scale: torch.Tensor | None,
                   col_scale: torch.Tensor | None, residual: bool, activation: bool) -> torch.Tensor:
    batch, seq_len, channels = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rs, cs, srs_b, srs_t = _scale_args(row_scale, col_scale, weight)
    _canon_fwd_kernel[_grid(batch, seq_len, channels)](
        x, weight, _bias_ptr(bias, weight), rs, cs, y, seq_len, channels, *x.stride(), srs_b, srs_t, *y.stride(),
        *weight.stride(), K=weight.shape[1], HAS_BIAS=bias is not None, RESIDUAL=residual, SILU=activation,
        SCALED=row_scale is not None)
    return y


@_canon_conv_op.register_fake
def _(x, weight, bias, row_scale, col_scale, residual, activation):
    return x.new_empty(x.shape)


@torch.library.custom_op("canon_titan::canon_conv_backward", mutates_args=())
def _canon_conv_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            row_scale: torch.Tensor | None, col_scale: torch.Tensor | None, residual: bool,
                            activation: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the convolution's input (after scaling), weight and bias."""
    batch, seq_len, channels = x.shape
    kernel = weight.shape[1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty_like(dx) if activation else dx
    partial_dw, partial_db = _partials(batch, seq_len, kernel, channels, x)
    rs, cs, srs_b, srs_t = _scale_args(row_scale, col_scale, weight)
    _canon_bwd_kernel[_grid(batch, seq_len, channels, _CHUNK_T)](
        x, weight, _bias_ptr(bias, weight), rs, cs, dy, dz, dx, partial_dw, partial_db, seq_len, channels,
        *x.stride(), srs_b, srs_t, *dy.stride(), *dx.stride(), *weight.stride(),
        K=kernel, K_PAD=triton.next_power_of_2(kernel), HAS_BIAS=bias is not None, RESIDUAL=residual,
        SILU=activation, SCALED=row_scale is not None, CHUNK_T=_CHUNK_T)
    if activation:
        _canon_dx_kernel[_grid(batch, seq_len, channels)](
            dz, dy, weight, dx, seq_len, channels, *dz.stride(), *dy.stride(), *dx.stride(), *weight.stride(),
            K=kernel, HAS_RES=residual)
    return (dx, *_weight_grads(partial_dw, partial_db, weight, bias))


@_canon_conv_backward_op.register_fake
def _(dy, x, weight, bias, row_scale, col_scale, residual, activation):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(bias.shape if bias is not None else 0)


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
    batch, seq_len, hidden = gate.shape
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _canon_swiglu_fwd_kernel[_grid(batch, seq_len, hidden)](
        gate, up, weight, _bias_ptr(bias, weight), y, seq_len, hidden, *gate.stride(), *up.stride(), *y.stride(),
        *weight.stride(), K=weight.shape[1], HAS_BIAS=bias is not None, RESIDUAL=residual, SILU=activation)
    return y


@_canon_swiglu_op.register_fake
def _(gate, up, weight, bias, residual, activation):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("canon_titan::canon_swiglu_backward", mutates_args=())
def _canon_swiglu_backward_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None, residual: bool, activation: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, seq_len, hidden = gate.shape
    kernel = weight.shape[1]
    dz = torch.empty(2, batch, seq_len, hidden, dtype=gate.dtype, device=gate.device)
    # With residual and SiLU, the residual gradient (of the Canon output) differs from dz.
    res = torch.empty_like(dz) if residual and activation else dz
    partial_dw, partial_db = _partials(batch, seq_len, kernel, 2 * hidden, gate)
    _canon_swiglu_bwd_kernel[_grid(batch, seq_len, hidden, _CHUNK_T)](
        gate, up, weight, _bias_ptr(bias, weight), dy, dz, res, partial_dw, partial_db, seq_len, hidden,
        *gate.stride(), *up.stride(), *dy.stride(), *weight.stride(),
        K=kernel, K_PAD=triton.next_power_of_2(kernel), HAS_BIAS=bias is not None, RESIDUAL=residual,
        SILU=activation, CHUNK_T=_CHUNK_T)
    grads = []
    for half, w in zip(range(2), weight.split(hidden)):
        dx = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        _canon_dx_kernel[_grid(batch, seq_len, hidden)](
            dz[half], res[half], w, dx, seq_len, hidden, *dz[half].stride(), *res[half].stride(), *dx.stride(),
            *w.stride(), K=kernel, HAS_RES=residual)
        grads.append(dx)
    return (*grads, *_weight_grads(partial_dw, partial_db, weight, bias))


@_canon_swiglu_backward_op.register_fake
def _(dy, gate, up, weight, bias, residual, activation):
    return (gate.new_empty(gate.shape), up.new_empty(up.shape), weight.new_empty(weight.shape),
            weight.new_empty(bias.shape if bias is not None else 0))


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
