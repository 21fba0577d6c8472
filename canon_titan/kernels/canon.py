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
- ``triton``: Triton kernels behind ``torch.library.triton_op``s (``canon_titan::canon_conv``,
  ``canon_titan::canon_swiglu``) with autograd, so a compiled block has no graph break and Inductor
  launches the kernels from its own code. They read the [B, T, C] layout with any strides (no
  transposes, no copies). The backward saves only the op's inputs and recomputes the convolution; the
  fused SwiGLU op saves gate and up (what SwiGLU alone saves), not the Canon outputs. With a fused
  norm and no SiLU, the input's gradient is torch ops that Inductor fuses with the norm's backward
  (``_canon_conv_grad``). The forward kernels' blocks are autotuned, the
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


def _canon_torch(x, weight, bias, residual: bool, activation: bool, positions=None):
    kernel, seq_len = weight.shape[-1], x.shape[1]
    padded = F.pad(x, (0, 0, kernel - 1, 0))
    y = x * weight[:, kernel - 1]
    for j in range(kernel - 1):
        shifted = padded[:, j : j + seq_len]
        if positions is not None:  # the tap reaching back K-1-j rows stays inside the document
            shifted = shifted.masked_fill((positions < kernel - 1 - j).unsqueeze(-1), 0)
        y = y + shifted * weight[:, j]
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
sm_90, 64-72 registers here, 96 and 163 there (the per-tap accumulators), no spills. Measured on an H200
(2026-11-27, ``bench_canon.py --mode bwd_blocks``, batch 2 x 4096), 16x32/4w was the fastest of five
candidates for every call: Canon-A at 2048 channels 0.071 ms (16x64/4w, the blocks before, 0.094),
Canon-D 0.584 ms, Mamba2's b 0.293 ms. Fixed, not autotuned: the weight gradient sums over a chunk's
rows in an order the blocks decide, so fixed blocks give the same bits in every process and run, where
autotuning would pick by timing."""
RECOMPUTING_BACKWARD_BLOCKS = {"BLOCK_T": 16, "BLOCK_C": 32, "num_warps": 4}

CHUNK_T = 128
"""Rows of the sequence one backward program reduces the weight gradient over (a multiple of every
BLOCK_T), or ``LONG_CHUNK_T`` (``_chunk_rows``). The partial sums hold batch * ceil(seq / rows) rows:
fp32 [parts, C, K], written by the kernel and read by the sum after it, 2 * 4 * K * C / rows bytes per
token (Canon-D of LlamaCanon-1B at 128 rows: 2.8 KB of the 58 KB its backward moves per token)."""
LONG_CHUNK_T = 512
MIN_PROGRAMS = 4096
"""Programs a backward launch keeps with ``LONG_CHUNK_T`` (two waves of an H100/H200's 132 SMs with 16
programs of 4 warps each)."""


def _chunk_rows(batch: int, seq_len: int, channels: int) -> int:
    """``LONG_CHUNK_T`` where it leaves ``MIN_PROGRAMS`` programs (LlamaCanon-1B at 8 x 4096), else
    ``CHUNK_T``. A function of the shape alone: the weight gradient has the same bits in every process
    and run."""
    programs = batch * triton.cdiv(seq_len, LONG_CHUNK_T) * triton.cdiv(channels, BACKWARD_BLOCKS["BLOCK_C"])
    return LONG_CHUNK_T if programs >= MIN_PROGRAMS else CHUNK_T


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
def _load_row_scaled(x_ptr, rs_ptr, rows, x_cols, col_mask, T, sx_t, srs_t, SCALED: tl.constexpr):
    """An input tile in float32: x, or ``x * row_scale[t]``."""
    in_seq = (rows >= 0) & (rows < T)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sx_t + x_cols[None, :], mask=in_seq[:, None] & col_mask[None, :],
                other=0.0).to(tl.float32)
    if SCALED:
        x = x * tl.load(rs_ptr + rows.to(tl.int64) * srs_t, mask=in_seq, other=0.0)[:, None]
    return x


@triton.jit
def _load_input(x_ptr, rs_ptr, cs, rows, x_cols, col_mask, T, sx_t, srs_t, SCALED: tl.constexpr):
    """An input tile in float32: x, or ``x * row_scale[t] * col_scale[c]`` (a fused RMSNorm)."""
    x = _load_row_scaled(x_ptr, rs_ptr, rows, x_cols, col_mask, T, sx_t, srs_t, SCALED)
    if SCALED:
        x = x * cs[None, :]
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
def _window(ptr, rs_ptr, cs, rows, col_offsets, col_mask, T, stride_t, srs_t, K: tl.constexpr,
            SCALED: tl.constexpr):
    """The input tiles (``_load_input``) at rows - 3 ... rows + 3: a tile and the K-1 rows each side that
    the convolutions at rows t .. t+K-1 read, each loaded once; zeros for shifts of K or more."""
    x0 = _load_input(ptr, rs_ptr, cs, rows, col_offsets, col_mask, T, stride_t, srs_t, SCALED)
    xm1, xm2, xm3 = tl.zeros_like(x0), tl.zeros_like(x0), tl.zeros_like(x0)
    xp1, xp2, xp3 = tl.zeros_like(x0), tl.zeros_like(x0), tl.zeros_like(x0)
    if K > 1:
        xm1 = _load_input(ptr, rs_ptr, cs, rows - 1, col_offsets, col_mask, T, stride_t, srs_t, SCALED)
        xp1 = _load_input(ptr, rs_ptr, cs, rows + 1, col_offsets, col_mask, T, stride_t, srs_t, SCALED)
    if K > 2:
        xm2 = _load_input(ptr, rs_ptr, cs, rows - 2, col_offsets, col_mask, T, stride_t, srs_t, SCALED)
        xp2 = _load_input(ptr, rs_ptr, cs, rows + 2, col_offsets, col_mask, T, stride_t, srs_t, SCALED)
    if K > 3:
        xm3 = _load_input(ptr, rs_ptr, cs, rows - 3, col_offsets, col_mask, T, stride_t, srs_t, SCALED)
        xp3 = _load_input(ptr, rs_ptr, cs, rows + 3, col_offsets, col_mask, T, stride_t, srs_t, SCALED)
    return xm3, xm2, xm1, x0, xp1, xp2, xp3


@triton.jit
def _shifted(xm3, xm2, xm1, x0, xp1, xp2, xp3, SHIFT: tl.constexpr):
    """The window's tile at rows + SHIFT (a constant: no code for the others)."""
    out = x0
    if SHIFT == -3:
        out = xm3
    elif SHIFT == -2:
        out = xm2
    elif SHIFT == -1:
        out = xm1
    elif SHIFT == 1:
        out = xp1
    elif SHIFT == 2:
        out = xp2
    elif SHIFT == 3:
        out = xp3
    return out


@triton.jit
def _taps(w_ptr, w_cols, sw_k, col_mask, K: tl.constexpr):
    """The K weight taps of a program's columns, each [1, BLOCK_C] in float32 (zeros past K)."""
    w0 = _tap(w_ptr, w_cols, 0, sw_k, col_mask)
    w1, w2, w3 = tl.zeros_like(w0), tl.zeros_like(w0), tl.zeros_like(w0)
    if K > 1:
        w1 = _tap(w_ptr, w_cols, 1, sw_k, col_mask)
    if K > 2:
        w2 = _tap(w_ptr, w_cols, 2, sw_k, col_mask)
    if K > 3:
        w3 = _tap(w_ptr, w_cols, 3, sw_k, col_mask)
    return w0, w1, w2, w3


@triton.jit
def _tap_of(w0, w1, w2, w3, J: tl.constexpr):
    """Tap J of ``_taps``' (a constant)."""
    return _shifted(w0, w0, w0, w0, w1, w2, w3, J)


@triton.jit
def _window_conv(xm3, xm2, xm1, x0, xp1, xp2, xp3, w0, w1, w2, w3, bias, D: tl.constexpr, K: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """``_conv`` at rows + D from a window and the taps (the same products in the same order)."""
    pre = _shifted(xm3, xm2, xm1, x0, xp1, xp2, xp3, D - (K - 1)) * w0
    for j in tl.static_range(1, K):
        pre += _shifted(xm3, xm2, xm1, x0, xp1, xp2, xp3, D - (K - 1) + j) * _tap_of(w0, w1, w2, w3, j)
    if HAS_BIAS:
        pre += bias
    return pre


@triton.jit
def _canon_bwd_kernel(x_ptr, w_ptr, b_ptr, rs_ptr, cs_ptr, dy_ptr, dx_ptr, dw_ptr, db_ptr, dcs_ptr, T, C,
                      sx_b, sx_t, sx_c, srs_b, srs_t, sdy_b, sdy_t, sdy_c, sdx_b, sdx_t, sdx_c, sw_c, sw_k,
                      K: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                      SILU: tl.constexpr, SCALED: tl.constexpr, X_ALIGNED: tl.constexpr, STORE_DX: tl.constexpr,
                      COL_GRAD: tl.constexpr, CHUNK_T: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx (of the scaled input the convolution saw) unless STORE_DX is off, and the weight/bias gradient
    partials over CHUNK_T rows; with COL_GRAD (SCALED), the column scale's too: sum over rows of
    ``dx * x * row_scale``. dz = dy, times SiLU's derivative at ``pre`` with SiLU."""
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
    w0, w1, w2, w3 = _taps(w_ptr, w_cols, sw_k, col_mask, K)
    bias = tl.zeros_like(w0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    a0 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    db_rows = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    dcs_rows = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for t0 in range(0, CHUNK_T, BLOCK_T):
        rows = tl.program_id(0) * CHUNK_T + t0 + tl.arange(0, BLOCK_T)
        if SILU:  # the convolution at rows t .. t+K-1 again, from a window of 2K-1 input tiles
            xm3, xm2, xm1, x, xp1, xp2, xp3 = _window(x_ptr, rs_ptr, cs, rows, x_cols, col_mask, T, sx_t, srs_t, K,
                                                      SCALED)
        else:
            x_rows = _load_row_scaled(x_ptr, rs_ptr, rows, x_cols, col_mask, T, sx_t, srs_t, SCALED)
            x = x_rows
            if SCALED:
                x = x_rows * cs[None, :]
        dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for d in tl.static_range(K):
            dz = _load(dy_ptr, rows + d, dy_cols, T, sdy_t, col_mask)
            if RESIDUAL and d == 0:
                dx += dz
            if SILU:
                dz *= _silu_grad(_window_conv(xm3, xm2, xm1, x, xp1, xp2, xp3, w0, w1, w2, w3, bias, d, K, HAS_BIAS))
            if SILU:
                dx += _tap_of(w0, w1, w2, w3, K - 1 - d) * dz
            else:
                dx += _tap(w_ptr, w_cols, K - 1 - d, sw_k, col_mask) * dz
            a0, a1, a2, a3 = _add_to_tap(a0, a1, a2, a3, dz * x, K - 1 - d)
            if HAS_BIAS and d == 0:
                db_rows += dz
        if STORE_DX:
            _store(dx_ptr + batch * sdx_b, rows, dx_cols, T, sdx_t, col_mask, dx)
        if COL_GRAD:
            dcs_rows += dx * x_rows
    part = batch * tl.num_programs(0) + tl.program_id(0)
    _store_partials(dw_ptr, db_ptr, _taps_tile(a0, a1, a2, a3, K, K_PAD), tl.sum(db_rows, axis=0), part, C, cols,
                    col_mask, K, K_PAD, HAS_BIAS)
    if COL_GRAD:
        tl.store(dcs_ptr + part * C + cols, tl.sum(dcs_rows, axis=0), mask=col_mask)


@triton.jit
def _canon_swiglu_bwd_kernel(g_ptr, u_ptr, w_ptr, b_ptr, dy_ptr, dg_ptr, du_ptr, dw_ptr, db_ptr, T, H,
                             sg_b, sg_t, sg_c, su_b, su_t, su_c, sdy_b, sdy_t, sdy_c, sdx_b, sdx_t, sdx_c, sw_c, sw_k,
                             K: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                             SILU: tl.constexpr, CHUNK_T: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_C: tl.constexpr):
    """Gradients of gate and up (dg, du: same strides) and the weight/bias partials over CHUNK_T rows
    ([parts, 2H, K]). The Canon outputs' gradients (of ``silu(g) * u``) are d_gate and d_up; dz is
    theirs times SiLU's derivative at ``pre`` with SiLU. The convolutions at rows t .. t+K-1 read gate and
    up from a window of 2K-1 tiles loaded once per tile, with taps loaded once per program."""
    batch = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < H
    cols64 = cols.to(tl.int64)
    g_cols, u_cols, dy_cols, dx_cols, w_cols = cols64 * sg_c, cols64 * su_c, cols64 * sdy_c, cols64 * sdx_c, \
        cols64 * sw_c
    wg0, wg1, wg2, wg3 = _taps(w_ptr, w_cols, sw_k, col_mask, K)
    wu0, wu1, wu2, wu3 = _taps(w_ptr + H * sw_c, w_cols, sw_k, col_mask, K)
    bg = tl.zeros_like(wg0)
    bu = tl.zeros_like(wg0)
    if HAS_BIAS:
        bg = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        bu = tl.load(b_ptr + H + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
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
        gm3, gm2, gm1, g, gp1, gp2, gp3 = _window(g_ptr, g_ptr, bg, rows, g_cols, col_mask, T, sg_t, 0, K, False)
        um3, um2, um1, u, up1, up2, up3 = _window(u_ptr, u_ptr, bu, rows, u_cols, col_mask, T, su_t, 0, K, False)
        dx_g = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        dx_u = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for d in tl.static_range(K):
            pre_g = _window_conv(gm3, gm2, gm1, g, gp1, gp2, gp3, wg0, wg1, wg2, wg3, bg, d, K, HAS_BIAS)
            gate = _finish(pre_g, _shifted(gm3, gm2, gm1, g, gp1, gp2, gp3, d), RESIDUAL, SILU)
            pre_u = _window_conv(um3, um2, um1, u, up1, up2, up3, wu0, wu1, wu2, wu3, bu, d, K, HAS_BIAS)
            up = _finish(pre_u, _shifted(um3, um2, um1, u, up1, up2, up3, d), RESIDUAL, SILU)
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
            dx_g += _tap_of(wg0, wg1, wg2, wg3, K - 1 - d) * dz_g
            dx_u += _tap_of(wu0, wu1, wu2, wu3, K - 1 - d) * dz_u
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


def _partials(parts: int, kernel: int, channels: int, like: torch.Tensor, bias: bool):
    """fp32 partial sums of dw [parts, channels, K] and, with a bias, db [parts, channels]; without one
    db's pointer is dw's, never written."""
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


# ----------------------------------------------------------------------------- ops
#
# Each op's body allocates its outputs and launches its kernel through ``wrap_triton``, so that it is
# a ``torch.library.triton_op``: under torch.compile Inductor traces the body into the block's graph
# and launches the kernel from its own generated code (no Python frame of the op per call; the
# weight-gradient sums become Inductor kernels), and in eager mode the op runs the body as a custom
# op does. Torch cannot trace a kernel that Triton's interpreter runs, so under ``TRITON_INTERPRET=1``
# the ops are opaque custom ops with fake kernels, and their bodies launch the kernels as they are.


wrap_triton = (lambda kernel: kernel) if INTERPRETED else torch.library.wrap_triton


def _op(name: str, fake):
    def define(fn):
        if INTERPRETED:
            op = torch.library.custom_op(name, fn, mutates_args=())
            op.register_fake(fake)
            return op
        return torch.library.triton_op(name, fn, mutates_args=())
    return define


def _fake_conv_backward(dy, x, weight, bias, row_scale, col_scale, residual, activation):
    db = bias.new_empty(bias.shape) if bias is not None else weight.new_empty(0)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _fake_conv_weight_grads(dy, x, weight, bias, row_scale, col_scale, residual):
    db = bias.new_empty(bias.shape) if bias is not None else weight.new_empty(0)
    return col_scale.new_empty(col_scale.shape), weight.new_empty(weight.shape), db


def _fake_swiglu_backward(dy, gate, up, weight, bias, residual, activation):
    db = bias.new_empty(bias.shape) if bias is not None else weight.new_empty(0)
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape), weight.new_empty(weight.shape), db


def conv_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_scale: torch.Tensor | None,
                 col_scale: torch.Tensor | None, residual: bool, activation: bool) -> torch.Tensor:
    batch, seq_len, channels = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rs, cs, srs_b, srs_t = _scale_args(row_scale, col_scale, weight)
    wrap_triton(_canon_fwd_kernel)[_grid(batch, seq_len, channels)](
        x, weight, _bias_ptr(bias, weight), rs, cs, y, seq_len, channels, *x.stride(), srs_b, srs_t, *y.stride(),
        *weight.stride(), K=weight.shape[1], HAS_BIAS=bias is not None, RESIDUAL=residual, SILU=activation,
        SCALED=row_scale is not None, X_ALIGNED=_rows_aligned(x))
    return y


def _conv_backward(dy, x, weight, bias, row_scale, col_scale, residual: bool, activation: bool, input_grad: bool):
    """The backward kernel's launch: dx unless ``input_grad`` is off (then, with the scales, the column
    scale's gradient instead), and the weight/bias gradients."""
    batch, seq_len, channels = x.shape
    kernel, rows = weight.shape[1], _chunk_rows(batch, seq_len, channels)
    parts = batch * triton.cdiv(seq_len, rows)
    # Without the input's gradient, an empty tensor stands for dx (never written; Inductor would copy a
    # larger stand-in, as the kernel's stores to dx count as a mutation of whatever tensor is passed).
    dx = x.new_empty(x.shape if input_grad else (0, 0, 0))
    partial_dw, partial_db = _partials(parts, kernel, channels, x, bias is not None)
    col_grad = row_scale is not None and not input_grad
    partial_dcs = torch.empty(parts, channels, dtype=torch.float32, device=x.device) if col_grad else partial_dw
    rs, cs, srs_b, srs_t = _scale_args(row_scale, col_scale, weight)
    wrap_triton(_canon_bwd_kernel)[_grid(batch, seq_len, channels, rows)](
        x, weight, _bias_ptr(bias, weight), rs, cs, dy, dx, partial_dw, partial_db, partial_dcs, seq_len, channels,
        *x.stride(), srs_b, srs_t, *dy.stride(), *dx.stride(), *weight.stride(),
        K=kernel, K_PAD=triton.next_power_of_2(kernel), HAS_BIAS=bias is not None, RESIDUAL=residual,
        SILU=activation, SCALED=row_scale is not None, X_ALIGNED=_rows_aligned(x), STORE_DX=input_grad,
        COL_GRAD=col_grad, CHUNK_T=rows, **_backward_blocks(seq_len, channels, recomputes=activation))
    dw, db = _weight_grads(partial_dw, partial_db, weight, bias)
    if col_grad:
        return partial_dcs.sum(0).to(col_scale.dtype), dw, db
    return dx, dw, db


def conv_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  row_scale: torch.Tensor | None, col_scale: torch.Tensor | None, residual: bool,
                  activation: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the convolution's input (after scaling), weight and bias (empty without one)."""
    return _conv_backward(dy, x, weight, bias, row_scale, col_scale, residual, activation, input_grad=True)


def conv_weight_grads(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      row_scale: torch.Tensor, col_scale: torch.Tensor, residual: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Without SiLU, on a scaled input: the gradients of the column scale, the weight and the bias, and
    not dx, which ``_canon_conv_grad`` leaves to torch ops."""
    return _conv_backward(dy, x, weight, bias, row_scale, col_scale, residual, False, input_grad=False)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   residual: bool, activation: bool) -> torch.Tensor:
    batch, seq_len, hidden = gate.shape
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    wrap_triton(_canon_swiglu_fwd_kernel)[_grid(batch, seq_len, hidden)](
        gate, up, weight, _bias_ptr(bias, weight), y, seq_len, hidden, *gate.stride(), *up.stride(), *y.stride(),
        *weight.stride(), K=weight.shape[1], HAS_BIAS=bias is not None, RESIDUAL=residual, SILU=activation)
    return y


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, residual: bool, activation: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of gate, up, the weight and the bias (empty without one)."""
    batch, seq_len, hidden = gate.shape
    kernel = weight.shape[1]
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = _chunk_rows(batch, seq_len, hidden)
    partial_dw, partial_db = _partials(batch * triton.cdiv(seq_len, rows), kernel, 2 * hidden, gate, bias is not None)
    wrap_triton(_canon_swiglu_bwd_kernel)[_grid(batch, seq_len, hidden, rows)](
        gate, up, weight, _bias_ptr(bias, weight), dy, d_gate, d_up, partial_dw, partial_db, seq_len, hidden,
        *gate.stride(), *up.stride(), *dy.stride(), *d_gate.stride(), *weight.stride(),
        K=kernel, K_PAD=triton.next_power_of_2(kernel), HAS_BIAS=bias is not None, RESIDUAL=residual,
        SILU=activation, CHUNK_T=rows, **_backward_blocks(seq_len, hidden, recomputes=True))
    return (d_gate, d_up, *_weight_grads(partial_dw, partial_db, weight, bias))


_canon_conv_op = _op("canon_titan::canon_conv", lambda x, *args: x.new_empty(x.shape))(conv_forward)
_op("canon_titan::canon_conv_backward", _fake_conv_backward)(conv_backward)
_op("canon_titan::canon_conv_weight_grads", _fake_conv_weight_grads)(conv_weight_grads)
_canon_swiglu_op = _op("canon_titan::canon_swiglu", lambda gate, *args: gate.new_empty(gate.shape))(swiglu_forward)
_op("canon_titan::canon_swiglu_backward", _fake_swiglu_backward)(swiglu_backward)


def _canon_conv_setup(ctx, inputs, output):
    x, weight, bias, row_scale, col_scale, ctx.residual, ctx.activation = inputs
    ctx.save_for_backward(x, weight, bias, row_scale, col_scale)


def _transposed_conv(dy: torch.Tensor, weight: torch.Tensor, residual: bool) -> torch.Tensor:
    """The gradient of the convolution's input without SiLU, in float32: ``dy[t] (residual) + sum_d
    w[K-1-d] dy[t+d]`` (zeros past the last token)."""
    kernel, seq_len = weight.shape[-1], dy.shape[1]
    dy, weight = dy.float(), weight.float()
    padded = F.pad(dy, (0, 0, 0, kernel - 1))
    d_input = dy * (weight[:, kernel - 1] + 1) if residual else dy * weight[:, kernel - 1]
    for d in range(1, kernel):
        d_input = d_input + padded[:, d : d + seq_len] * weight[:, kernel - 1 - d]
    return d_input


def _canon_conv_grad(ctx, dy):
    x, weight, bias, row_scale, col_scale = ctx.saved_tensors
    if row_scale is None or ctx.activation:
        d_input, dw, db = torch.ops.canon_titan.canon_conv_backward(dy, x, weight, bias, row_scale, col_scale,
                                                                    ctx.residual, ctx.activation)
        d_col = None
    else:
        # A fused norm (Canon-A/C, Canon-B on q and k): the kernel reads x and dy once for the weight's and the
        # column scale's gradients, and the input's is left to torch ops, which Inductor fuses with the norm's
        # chain rule below and its backward into one pass that reads dy and x and writes dx, as Llama's RMSNorm
        # backward reads its input's gradient and x (the kernel writing d_input, and a pass for d_col reading it
        # and x again, cost 12 KB a token per call at 1B).
        d_col, dw, db = torch.ops.canon_titan.canon_conv_weight_grads(dy, x, weight, bias, row_scale, col_scale,
                                                                      ctx.residual)
        d_input = _transposed_conv(dy, weight, ctx.residual)
    db = db if bias is not None else None
    if row_scale is None:
        return d_input, dw, db, None, None, None, None
    # input = x * row_scale * col_scale, in float32 (traced: Inductor fuses these into one pass).
    d_input, xf, cs = d_input.float(), x.float(), col_scale.float()
    dx = (d_input * row_scale.unsqueeze(-1) * cs).to(x.dtype)
    d_row = (d_input * xf * cs).sum(-1).to(row_scale.dtype)
    if d_col is None:
        d_col = (d_input * xf * row_scale.unsqueeze(-1)).sum((0, 1)).to(col_scale.dtype)
    return dx, dw, db, d_row, d_col, None, None


_canon_conv_op.register_autograd(_canon_conv_grad, setup_context=_canon_conv_setup)


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


def canon_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    residual: bool = True,
    activation: bool = False,
    positions: torch.Tensor | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """x [B, T, C], weight [C, K] (index K-1 on the current token), bias [C] or None.

    With ``row_scale`` [B, T] and ``col_scale`` [C] the layer's input is ``x * row_scale * col_scale``
    computed in float32 (an RMSNorm fused in: its inverse RMS and weight): the torch backend rounds
    it to x's dtype as RMSNorm does, the Triton kernels keep it in float32 and never store it.

    With ``positions`` [B, T] (each token's position in its document, 0 at a document's first token)
    the tap reaching back s rows adds to ``out[b, t]`` only where ``positions[b, t] >= s``: packed
    documents are convolved as if each were alone.
    """
    if (row_scale is None) != (col_scale is None):
        raise ValueError("canon_conv: row_scale and col_scale go together")
    if _use_triton(backend, x, weight.shape[-1]):
        _refuse_positions(positions)
        return torch.ops.canon_titan.canon_conv(x, weight, bias, row_scale, col_scale, residual, activation)
    if row_scale is not None:
        x = (x.float() * row_scale.unsqueeze(-1) * col_scale.float()).type_as(x)
    return _canon_torch(x, weight, bias, residual, activation, positions)


def canon_swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: bool = True,
    activation: bool = False,
    positions: torch.Tensor | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """``silu(canon(gate)) * canon(up)`` with weight [2H, K] over [gate | up] (gate, up: [B, T, H]);
    ``positions`` as in ``canon_conv``."""
    if _use_triton(backend, gate, weight.shape[-1]):
        _refuse_positions(positions)
        return torch.ops.canon_titan.canon_swiglu(gate, up, weight, bias, residual, activation)
    hidden = gate.shape[-1]
    w_gate, w_up = weight.split(hidden)
    b_gate, b_up = bias.split(hidden) if bias is not None else (None, None)
    gate = _canon_torch(gate, w_gate, b_gate, residual, activation, positions)
    return F.silu(gate) * _canon_torch(up, w_up, b_up, residual, activation, positions)


def _refuse_positions(positions):
    if positions is not None:
        raise NotImplementedError(
            "canon op: document positions are not in the Triton kernels yet; use "
            'canon_backend = "torch" with document boundaries'
        )
