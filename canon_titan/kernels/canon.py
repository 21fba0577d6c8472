"""The Canon op: a causal depthwise convolution along the sequence, with optional bias, SiLU and
residual, on [batch, seq, channel] tensors.

    pre[t, c] = bias[c] + sum_j w[c, j] * x[t - (K-1) + j, c]      (zeros before the first token)
    out[t, c] = x[t, c] + act(pre[t, c])                           (act = SiLU or identity;
                                                                    the residual term is optional)

Two entry points: ``canon_conv`` (Canon-A/B/C, the linear models' short convolutions) and
``canon_swiglu``, Canon-D fused with the SwiGLU product that follows it:
``silu(canon(gate)) * canon(up)`` with one weight over ``[gate | up]``. Both take document positions
(packed documents convolved as if each were alone) and, under context parallelism, the halo rows
before each of a rank's runs of the sequence.

Backends:
- ``torch``: K shifted multiply-adds. Runs everywhere; under torch.compile Inductor fuses them.
- ``triton``: Triton kernels behind ``torch.library.triton_op``s (``canon_titan::canon_conv``,
  ``canon_titan::canon_swiglu``) with autograd, so a compiled block has no graph break and Inductor
  launches the kernels from its own code. The kernels walk the sequence, each input row loaded once
  (see "Triton kernels" below); they read the [B, T, C] layout with any strides (no transposes, no
  copies). The backward saves only the op's inputs and recomputes the convolution; the fused SwiGLU
  op saves gate and up (what SwiGLU alone saves), not the Canon outputs. With a fused norm and no
  SiLU, the input's gradient is torch ops that Inductor fuses with the norm's backward
  (``_canon_conv_grad``). Every kernel's blocks are fixed, not autotuned: each rank of a job runs
  the same configuration and times none, and the weight gradients are bitwise reproducible
  (``CANON_TITAN_FULL_AUTOTUNE=1`` autotunes the forward kernels instead). Runs on CUDA, or on CPU
  tensors when ``TRITON_INTERPRET=1`` is set before the import (Triton's interpreter: slow, for
  tests).
  ``python -m canon_titan.kernels.aot`` compiles the kernels for sm_90 without a GPU; their cost
  per element is in docs/benchmarks/kernels.md.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from canon_titan.kernels.backends import INTERPRETED, runs_cuda_kernel
from canon_titan.kernels.tuning import FULL_AUTOTUNE_ENV

TRITON_KERNEL_SIZES = (2, 3, 4)
"""Kernel sizes the Triton kernels are built for (every size a config allows)."""


# ----------------------------------------------------------------------------- torch backend


def _canon_torch(
    x, weight, bias, residual: bool, activation: bool, positions=None, halo=None, split=-1
):
    kernel, seq_len = weight.shape[-1], x.shape[1]
    if halo is not None:  # each run with its halo rows in front
        k = kernel - 1
        bounds = [0, split, seq_len] if split >= 0 else [0, seq_len]
        outs = []
        for r, (start, end) in enumerate(zip(bounds, bounds[1:])):
            rows = torch.cat([halo[:, r * k : (r + 1) * k], x[:, start:end]], dim=1)
            run_positions = None if positions is None else F.pad(positions[:, start:end], (k, 0))
            outs.append(
                _canon_torch(rows, weight, bias, residual, activation, run_positions)[:, k:]
            )
        return torch.cat(outs, dim=1)
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


# ----------------------------------------------------------------------------- Triton blocks

FORWARD_BLOCKS = {"BLOCK_C": 128, "CHUNK": 64, "STREAMS": 1, "U": 4, "num_warps": 1}
"""The forward kernels' configuration: a program walks CHUNK rows of BLOCK_C channels, 4 channels a
thread (8-byte loads; at 2 a thread the per-row work of a walk is shared by too few elements), one
warp. Fixed, not autotuned: every rank of a job runs the same blocks and none times candidates at
its first step (under torch.compile Inductor would autotune in each process, out of reach of
``kernels/tuning.py``'s rank-0 choice, and at a thousand ranks some rank picks badly and the step
runs at its pace). Of ``FORWARD_CONFIGS``, the compiled kernels' cost (``plan/kernel_cost.py``,
sm_90 SASS and bytes) finds none faster at any forward call of a LlamaCanon-1B layer at 8 x 4096
(most tie: the kernels are memory-bound; ``tests/test_kernel_cost_guard.py`` holds it there)."""

FORWARD_CONFIGS = [
    triton.Config({"BLOCK_C": c, "CHUNK": t, "STREAMS": 1, "U": 4}, num_warps=w)
    for c, t, w in ((128, 64, 1), (128, 128, 1), (256, 64, 2), (256, 128, 2))
]
"""The forward kernels' autotuning space with ``CANON_TITAN_FULL_AUTOTUNE=1`` (set before the
import; to compare on a new GPU): 1 or 2 warps (``python -m canon_titan.kernels.aot`` prints their
registers)."""

FORWARD_AUTOTUNED = not INTERPRETED and os.environ.get(FULL_AUTOTUNE_ENV) == "1"

BACKWARD_BLOCKS = {"BLOCK_C": 128, "STREAMS": 1, "U": 8, "num_warps": 1}
"""The backward kernels' configuration, fixed (not autotuned): the weight gradient sums a chunk's
rows in row order, so fixed blocks give the same bits in every process and run, where autotuning
would pick by timing. Four channels a thread (the per-row work of a walk shared by more elements),
and the next U rows' loads in flight while a program works on U: its chunks are long (so that their
partial sums stay small), and a launch's loads in flight are U / CHUNK of its tensors. The SwiGLU
backward reads three tensors where the convolution's reads two, and holds twice its state: two
channels a thread and 4 rows (``SWIGLU_BACKWARD_BLOCKS``; at four its state would take some 230
registers), its row strides compile-time constants (a row's address is then one multiply-add of
a constant, where it took three instructions) and its loop unrolled twice (the carried rows then
change registers without copies)."""
SWIGLU_BACKWARD_BLOCKS = {**BACKWARD_BLOCKS, "BLOCK_C": 64, "U": 4}

CHUNK_T = 128
"""Rows of the sequence one backward program reduces the weight gradient over, or ``LONG_CHUNK_T``
(``_chunk_rows``). The partial sums hold batch * ceil(seq / rows) rows: fp32 [parts, C, K], written
by the kernel and read by the sum after it, 2 * 4 * K * C / rows bytes per token."""
LONG_CHUNK_T = 512
MIN_PROGRAMS = 1024
"""Programs a backward launch keeps with ``LONG_CHUNK_T`` (about 8 one-warp programs an SM of an
H100/H200)."""


def _chunk_rows(batch: int, seq_len: int, channels: int, blocks: dict) -> int:
    """``LONG_CHUNK_T`` where it leaves ``MIN_PROGRAMS`` programs of ``blocks`` (LlamaCanon-1B at
    8 x 4096), else ``CHUNK_T``. A function of the shape alone: the weight gradient has the same
    bits in every process and run."""
    chunks = batch * triton.cdiv(seq_len, LONG_CHUNK_T)
    programs = chunks * triton.cdiv(channels, blocks["BLOCK_C"])
    return LONG_CHUNK_T if programs >= MIN_PROGRAMS else CHUNK_T


def _interpreter_blocks(channels: int, chunk: int, unroll: int) -> dict:
    """Under the interpreter, whose cost is per program instance and per block op: one block across
    the channels (up to 512), and a chunk's rows walked as runs of ``unroll`` rows side by side."""
    return {
        "BLOCK_C": min(512, triton.next_power_of_2(channels)),
        "CHUNK": chunk,
        "STREAMS": chunk // unroll,
        "U": unroll,
    }


def _forward_blocks(channels: str, *keys: str):
    """Blocks of a forward kernel: ``FORWARD_BLOCKS``, given at the launch (``_forward_launch``);
    with ``FORWARD_AUTOTUNED``, autotuned (a forward element's value does not depend on them), the
    timings kept on disk (Triton's cache); under the interpreter, ``_interpreter_blocks``."""
    if INTERPRETED:
        return triton.heuristics(
            {
                name: lambda a, name=name: _interpreter_blocks(a[channels], CHUNK_T, 4)[name]
                for name in ("BLOCK_C", "CHUNK", "STREAMS", "U")
            }
        )
    if FORWARD_AUTOTUNED:
        return triton.autotune(configs=FORWARD_CONFIGS, key=[channels, *keys], cache_results=True)
    return lambda kernel: kernel


def _forward_launch() -> dict:
    """The blocks a forward launch passes: none where ``_forward_blocks`` decides them."""
    return {} if INTERPRETED or FORWARD_AUTOTUNED else dict(FORWARD_BLOCKS)


def _backward_blocks(channels: int, rows: int, blocks: dict) -> dict:
    if INTERPRETED:
        return {**_interpreter_blocks(channels, rows, blocks["U"]), "num_warps": 1}
    return {**blocks, "CHUNK": rows}


# ----------------------------------------------------------------------------- Triton kernels
#
# Every kernel walks the sequence. A program owns BLOCK_C channels of CHUNK consecutive rows of one
# sequence, split into STREAMS runs of CHUNK / STREAMS rows walked side by side (one on a GPU; many
# in the interpreter, whose cost is per block op), and visits each run's rows in order, U at a time
# (unrolled): each input row is loaded, converted and scaled (a fused norm) once, and the K-1 rows
# before it stay in registers as a tuple carried by the loop, which the unrolled rows rotate by
# renaming, so a row costs K multiply-adds whatever K is. The next U rows' loads are issued before
# the current U rows are computed. A run reads the K-1 rows before it again (the halo: (K-1) /
# (CHUNK / STREAMS) more reads, mostly from L2).
#
# The backward kernels walk forward too, and scatter each row's dz (the gradient of the convolution
# before its activation) to the rows it read: dx[t-s] += w[K-1-s] * dz[t]. The K-1 rows of dx still
# receiving are carried, and a row is stored once complete, K-1 rows later: a run walks K-1 rows
# past its end (recomputing dz there, as the next run does too) and stores its own rows only. The
# weight gradient of tap K-1-s sums dz[t] * input[t-s] over the run's rows in registers, in row
# order, and over the runs at the end, so fixed blocks give the same bits in every process and run.
#
# With document positions a row's taps reaching back further than its position are left out: one
# scalar per row, tested once; the masked arithmetic runs only on the rows near a document start (a
# branch the whole program takes together).


@triton.jit
def _row_stride(stride, ALIGNED: tl.constexpr):
    """A row stride, marked a multiple of 8 elements when the host checked it is: rows then start on
    16-byte boundaries and loads vectorise (Triton itself only recognises multiples of 16)."""
    if ALIGNED:
        stride = (stride // 8) * 8
    return stride


@triton.jit
def _load_rows(
    ptr, rs_ptr, rows, stride, srs_t, limit, col_mask, U: tl.constexpr, SCALED: tl.constexpr
):
    """Rows ``rows`` .. ``rows``+U-1 of each run as stored (``ptr``: row 0 of the program's
    channels), and their row scales: zeros outside 0 <= row < limit."""
    values = ()
    scales = ()
    for i in tl.static_range(U):
        t = rows + i
        in_seq = (t >= 0) & (t < limit)
        values = values + (
            tl.load(ptr + t[:, None] * stride, mask=col_mask & in_seq[:, None], other=0.0),
        )
        if SCALED:
            scales = scales + (tl.load(rs_ptr + t * srs_t, mask=in_seq, other=0.0)[:, None],)
        else:
            scales = scales + (1.0,)
    return values, scales


@triton.jit
def _positions(pos_ptr, rows, spos_t, limit, U: tl.constexpr, HAS_POS: tl.constexpr):
    """The document positions of rows ``rows`` .. ``rows``+U-1 of each run (0 outside 0 <= row <
    limit), or zeros (constants) without positions."""
    positions = ()
    for i in tl.static_range(U):
        t = rows + i
        if HAS_POS:
            positions = positions + (
                tl.load(pos_ptr + t * spos_t, mask=(t >= 0) & (t < limit), other=0),
            )
        else:
            positions = positions + (0,)
    return positions


@triton.jit
def _last_position(pos_ptr, rows, spos_t, limit, U: tl.constexpr, HAS_POS: tl.constexpr):
    """The document position of each run's row ``rows``+U-1, the last of a group (0 without
    positions or outside 0 <= row < limit)."""
    last = 0
    if HAS_POS:
        t = rows + U - 1
        last = tl.load(pos_ptr + t * spos_t, mask=(t >= 0) & (t < limit), other=0).to(tl.int32)
    return last


@triton.jit
def _near_document_start(last, U: tl.constexpr, K: tl.constexpr):
    """Whether a group of U rows whose last row is at document position ``last`` (each run's) has a
    row less than K-1 rows into its document: positions count up by one within a document, so one
    position per group tells, and only such groups take the masked arithmetic."""
    return tl.min(last, 0) < U + K - 2


@triton.jit
def _input(raw, scale, SCALED: tl.constexpr):
    """A row of the convolution's input in float32: x, or ``x * row_scale`` (the column scale of a
    fused norm is folded into the taps)."""
    u = raw.to(tl.float32)
    if SCALED:
        u = u * scale
    return u


@triton.jit
def _window(
    ptr,
    rs_ptr,
    halo,
    starts,
    lo,
    end,
    stride,
    srs_t,
    sh_t,
    col_mask,
    K: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_HALO: tl.constexpr,
):
    """The convolution's inputs at rows starts-1 .. starts-K+1, the window a walk starts with
    (element s-1: row starts-s): rows of the sequence run [lo, end); before it, the run's halo rows
    (``halo``: its row lo-K+1, as stored: the input before the column scale) or zeros."""
    window = ()
    for s in tl.static_range(1, K):
        t = starts - s
        in_run = (t >= lo) & (t < end)
        raw = tl.load(ptr + t[:, None] * stride, mask=col_mask & in_run[:, None], other=0.0)
        scale = 1.0
        if SCALED:
            scale = tl.load(rs_ptr + t * srs_t, mask=in_run, other=0.0)[:, None]
        u = _input(raw, scale, SCALED)
        if HAS_HALO:
            before = t - (lo - (K - 1))
            halo_mask = col_mask & ((before >= 0) & (t < lo))[:, None]
            u += tl.load(halo + before[:, None] * sh_t, mask=halo_mask, other=0.0).to(tl.float32)
        window = window + (u,)
    return window


@triton.jit
def _copies(value, N: tl.constexpr):
    out = ()
    for _ in tl.static_range(N):
        out = out + (value,)
    return out


@triton.jit
def _shift(window, u, K: tl.constexpr):
    """The window one row on: ``u`` becomes the row before the next one."""
    if K > 2:
        window = (u,) + window[: K - 2]
    elif K == 2:
        window = (u,)
    return window


@triton.jit
def _taps(w_ptr, cols, sw_c, sw_k, col_mask, scale, K: tl.constexpr, SCALED: tl.constexpr):
    """The K taps of the program's channels in float32, [1, BLOCK_C] each (element j multiplies
    input[t-(K-1)+j]), times the column scale of a fused norm."""
    taps = ()
    for j in tl.static_range(K):
        tap = tl.load(w_ptr + cols * sw_c + j * sw_k, mask=col_mask, other=0.0).to(tl.float32)
        if SCALED:
            tap = tap * scale
        taps = taps + (tap,)
    return taps


@triton.jit
def _conv(
    u, window, taps, bias, reach, K: tl.constexpr, HAS_BIAS: tl.constexpr, MASKED: tl.constexpr
):
    """pre = bias + sum_j taps[j] * input[t-(K-1)+j] at one row (``u``: its input, window[s-1]: the
    input s rows back), in the torch backend's order; with MASKED, the taps reaching back more than
    ``reach`` (a run's) rows left out."""
    pre = u * taps[K - 1]
    for j in tl.static_range(K - 1):
        term = window[K - 2 - j] * taps[j]
        if MASKED:
            term = tl.where(reach[:, None] >= K - 1 - j, term, 0.0)
        pre += term
    if HAS_BIAS:
        pre += bias
    return pre


FAST_MATH = tl.constexpr(not INTERPRETED)
"""The GPU's approximate exp2 and reciprocal (flush-to-zero) in the sigmoids: two special-function
instructions each, without ``tl.sigmoid``'s handling of denormals (the interpreter has no PTX)."""


@triton.jit
def _sigmoid(x):
    if FAST_MATH:
        e = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;",
            "=f,f",
            [x * -1.4426950408889634],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [e + 1.0], dtype=tl.float32, is_pure=True, pack=1
        )
    return tl.sigmoid(x)


@triton.jit
def _with_residual(taps, scale, K: tl.constexpr):
    """The taps with the residual folded into the current row's: ``input + conv(input)`` is the
    convolution with ``taps[K-1] + scale`` (no SiLU between them)."""
    return taps[: K - 1] + (taps[K - 1] + scale,)


@triton.jit
def _silu_grad(pre):
    s = _sigmoid(pre)
    return s * (1.0 + pre * (1.0 - s))


@triton.jit
def _add_tap_terms(acc, dz, u, window, reach, K: tl.constexpr, MASKED: tl.constexpr):
    """The per-tap sums of dz[t] * input[t-(K-1)+j], one row on."""
    out = ()
    for j in tl.static_range(K):
        if j == K - 1:
            out = out + (acc[j] + dz * u,)
        else:
            term = dz * window[K - 2 - j]
            if MASKED:
                term = tl.where(reach[:, None] >= K - 1 - j, term, 0.0)
            out = out + (acc[j] + term,)
    return out


@triton.jit
def _scatter(
    pending, dz, d_out, taps, reach, K: tl.constexpr, RESIDUAL: tl.constexpr, MASKED: tl.constexpr
):
    """dz[t] added to the input gradients of the rows it read: ``pending[s-1]``, row t-s's so far;
    returns the complete one of row t-K+1 and the pending rows one row on (with row t's, which
    starts with the residual's ``d_out``)."""
    own = dz * taps[K - 1]
    if RESIDUAL:
        own += d_out
    out = ()
    for s in tl.static_range(1, K):
        term = dz * taps[K - 1 - s]
        if MASKED:
            term = tl.where(reach[:, None] >= s, term, 0.0)
        out = out + (pending[s - 1] + term,)
    return out[K - 2], _shift(out, own, K)


@triton.jit
def _store_rows(ptr, rows, stride, lo, hi, col_mask, value):
    """Each run's row ``rows`` where lo <= row < hi."""
    in_range = (rows >= lo) & (rows < hi)
    tl.store(
        ptr + rows[:, None] * stride,
        value.to(ptr.dtype.element_ty),
        mask=col_mask & in_range[:, None],
    )


@triton.jit
def _store_taps(dw_ptr, acc, part, C, cols, mask, scale, K: tl.constexpr):
    """A program's per-tap sums over its runs (times the column scale of a fused norm) at [part, c,
    j] of a [parts, C, K] tensor."""
    for j in tl.static_range(K):
        tl.store(dw_ptr + (part * C + cols) * K + j, tl.sum(acc[j], axis=0) * scale, mask=mask)


@triton.jit
def _walks(split, T, CHUNK: tl.constexpr, STREAMS: tl.constexpr):
    """The program's chunk of rows, in one of the sequence runs [0, split) and [split, T) (a
    context- parallel rank's two runs; split = T without): the first rows of its walks [STREAMS] and
    their ends, the run's first row, how many rows the first walk has, and the run's number."""
    pid = tl.program_id(0)
    first_run = tl.cdiv(split, CHUNK)
    second = pid >= first_run
    lo = tl.where(second, split, 0)
    start = tl.where(second, split + (pid - first_run) * CHUNK, pid * CHUNK)
    end = tl.where(second, T, split)
    starts = start + tl.arange(0, STREAMS) * (CHUNK // STREAMS)
    ends = tl.minimum(starts + CHUNK // STREAMS, end)
    return starts, ends, lo, end, tl.minimum(CHUNK // STREAMS, end - start), second.to(tl.int32)


@triton.jit
def _store_halo_rows(ptr, rows, stride, lo, starts, col_mask, value, K: tl.constexpr):
    """The gradient of a run's halo row ``rows`` (lo-K+1 <= row < lo), by the run's first walk."""
    before = rows - (lo - (K - 1))
    mask = col_mask & ((before >= 0) & (rows < lo) & (starts == lo))[:, None]
    tl.store(ptr + before[:, None] * stride, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_rows(
    y,
    rows,
    scales,
    positions,
    first,
    window,
    taps,
    cs,
    bias,
    sy_t,
    ends,
    col_mask,
    K: tl.constexpr,
    U: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    SCALED: tl.constexpr,
    MASKED: tl.constexpr,
):
    """U rows of ``_canon_fwd_kernel``'s walk from row ``first`` of each run, stored; the window
    after them."""
    for i in tl.static_range(U):
        u = _input(rows[i], scales[i], SCALED)
        pre = _conv(u, window, taps, bias, positions[i], K, HAS_BIAS, MASKED)
        if SILU:
            pre = pre * _sigmoid(pre)
        if RESIDUAL:
            pre += u * cs
        _store_rows(y, first + i, sy_t, 0, ends, col_mask, pre)
        window = _shift(window, u, K)
    return window


@triton.jit
def _swiglu_rows(
    y,
    rows_g,
    rows_u,
    positions,
    first,
    window_g,
    window_u,
    taps_g,
    taps_u,
    bias_g,
    bias_u,
    sy_t,
    ends,
    col_mask,
    K: tl.constexpr,
    U: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    MASKED: tl.constexpr,
):
    """U rows of ``_canon_swiglu_fwd_kernel``'s walk, stored; the windows after them."""
    for i in tl.static_range(U):
        xg = rows_g[i].to(tl.float32)
        xu = rows_u[i].to(tl.float32)
        pre_g = _conv(xg, window_g, taps_g, bias_g, positions[i], K, HAS_BIAS, MASKED)
        pre_u = _conv(xu, window_u, taps_u, bias_u, positions[i], K, HAS_BIAS, MASKED)
        if SILU:
            pre_g = pre_g * _sigmoid(pre_g)
            pre_u = pre_u * _sigmoid(pre_u)
        if RESIDUAL:
            pre_g += xg
            pre_u += xu
        _store_rows(y, first + i, sy_t, 0, ends, col_mask, pre_g * _sigmoid(pre_g) * pre_u)
        window_g = _shift(window_g, xg, K)
        window_u = _shift(window_u, xu, K)
    return window_g, window_u


@_forward_blocks("C", "K", "HAS_BIAS", "RESIDUAL", "SILU", "SCALED")
@triton.jit
def _canon_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    rs_ptr,
    cs_ptr,
    pos_ptr,
    halo_ptr,
    y_ptr,
    T,
    C,
    split,
    sx_b,
    sx_t,
    sx_c,
    srs_b,
    srs_t,
    spos_b,
    spos_t,
    sh_b,
    sh_t,
    sh_c,
    sy_b,
    sy_t,
    sy_c,
    sw_c,
    sw_k,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_HALO: tl.constexpr,
    X_ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    U: tl.constexpr,
):
    """y = [input +] act(conv(input)) with input = x, or x * row_scale * col_scale (a fused
    norm)."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = (cols < C)[None, :]
    batch = tl.program_id(2).to(tl.int64)
    starts, ends, lo, end, walked, run = _walks(split, T, CHUNK, STREAMS)
    halo = halo_ptr + batch * sh_b + run * (K - 1) * sh_t + cols[None, :] * sh_c
    x = x_ptr + batch * sx_b + cols[None, :] * sx_c
    y = y_ptr + batch * sy_b + cols[None, :] * sy_c
    rs = rs_ptr + batch * srs_b
    pos = pos_ptr + batch * spos_b
    sx_t = _row_stride(sx_t, X_ALIGNED)
    cs = tl.full([1, BLOCK_C], 1.0, tl.float32)
    if SCALED:
        cs = tl.load(cs_ptr + cols[None, :], mask=col_mask, other=0.0).to(tl.float32)
    taps = _taps(w_ptr, cols[None, :], sw_c, sw_k, col_mask, cs, K, SCALED)
    if RESIDUAL and not SILU:
        taps = _with_residual(taps, cs, K)
    bias = tl.zeros([1, BLOCK_C], tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols[None, :], mask=col_mask, other=0.0).to(tl.float32)
    window = _window(x, rs, halo, starts, lo, end, sx_t, srs_t, sh_t, col_mask, K, SCALED, HAS_HALO)
    ahead = _load_rows(x, rs, starts, sx_t, srs_t, ends, col_mask, U, SCALED)
    ahead_last = _last_position(pos, starts, spos_t, ends, U, HAS_POS)
    unmasked = _copies(0, U)
    for t0 in range(0, walked, U):
        rows, scales = ahead
        last = ahead_last
        ahead = _load_rows(x, rs, starts + t0 + U, sx_t, srs_t, ends, col_mask, U, SCALED)
        ahead_last = _last_position(pos, starts + t0 + U, spos_t, ends, U, HAS_POS)
        masked = False
        if HAS_POS:
            masked = _near_document_start(last, U, K)
        if masked:
            positions = _positions(pos, starts + t0, spos_t, ends, U, HAS_POS)
            window = _conv_rows(
                y,
                rows,
                scales,
                positions,
                starts + t0,
                window,
                taps,
                cs,
                bias,
                sy_t,
                ends,
                col_mask,
                K,
                U,
                HAS_BIAS,
                RESIDUAL and SILU,
                SILU,
                SCALED,
                True,
            )
        else:
            window = _conv_rows(
                y,
                rows,
                scales,
                unmasked,
                starts + t0,
                window,
                taps,
                cs,
                bias,
                sy_t,
                ends,
                col_mask,
                K,
                U,
                HAS_BIAS,
                RESIDUAL and SILU,
                SILU,
                SCALED,
                False,
            )


@_forward_blocks("H", "K", "HAS_BIAS", "RESIDUAL", "SILU")
@triton.jit
def _canon_swiglu_fwd_kernel(
    g_ptr,
    u_ptr,
    w_ptr,
    b_ptr,
    pos_ptr,
    hg_ptr,
    hu_ptr,
    y_ptr,
    T,
    H,
    split,
    sg_b,
    sg_t,
    sg_c,
    su_b,
    su_t,
    su_c,
    spos_b,
    spos_t,
    sh_b,
    sh_t,
    sh_c,
    sy_b,
    sy_t,
    sy_c,
    sw_c,
    sw_k,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_HALO: tl.constexpr,
    CHUNK: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    U: tl.constexpr,
):
    """y = silu(canon(gate)) * canon(up), the two with the weight's rows [0, H) and [H, 2H)."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = (cols < H)[None, :]
    batch = tl.program_id(2).to(tl.int64)
    starts, ends, lo, end, walked, run = _walks(split, T, CHUNK, STREAMS)
    halo_offsets = batch * sh_b + run * (K - 1) * sh_t + cols[None, :] * sh_c
    g = g_ptr + batch * sg_b + cols[None, :] * sg_c
    u = u_ptr + batch * su_b + cols[None, :] * su_c
    y = y_ptr + batch * sy_b + cols[None, :] * sy_c
    pos = pos_ptr + batch * spos_b
    ones = tl.full([1, BLOCK_C], 1.0, tl.float32)
    taps_g = _taps(w_ptr, cols[None, :], sw_c, sw_k, col_mask, ones, K, False)
    taps_u = _taps(w_ptr + H * sw_c, cols[None, :], sw_c, sw_k, col_mask, ones, K, False)
    if RESIDUAL and not SILU:
        taps_g = _with_residual(taps_g, ones, K)
        taps_u = _with_residual(taps_u, ones, K)
    bias_g = tl.zeros([1, BLOCK_C], tl.float32)
    bias_u = tl.zeros([1, BLOCK_C], tl.float32)
    if HAS_BIAS:
        bias_g = tl.load(b_ptr + cols[None, :], mask=col_mask, other=0.0).to(tl.float32)
        bias_u = tl.load(b_ptr + H + cols[None, :], mask=col_mask, other=0.0).to(tl.float32)
    window_g = _window(
        g, g, hg_ptr + halo_offsets, starts, lo, end, sg_t, 0, sh_t, col_mask, K, False, HAS_HALO
    )
    window_u = _window(
        u, u, hu_ptr + halo_offsets, starts, lo, end, su_t, 0, sh_t, col_mask, K, False, HAS_HALO
    )
    ahead_g = _load_rows(g, g, starts, sg_t, 0, ends, col_mask, U, False)
    ahead_u = _load_rows(u, u, starts, su_t, 0, ends, col_mask, U, False)
    ahead_last = _last_position(pos, starts, spos_t, ends, U, HAS_POS)
    unmasked = _copies(0, U)
    for t0 in range(0, walked, U):
        rows_g, _ = ahead_g
        rows_u, _ = ahead_u
        last = ahead_last
        ahead_g = _load_rows(g, g, starts + t0 + U, sg_t, 0, ends, col_mask, U, False)
        ahead_u = _load_rows(u, u, starts + t0 + U, su_t, 0, ends, col_mask, U, False)
        ahead_last = _last_position(pos, starts + t0 + U, spos_t, ends, U, HAS_POS)
        masked = False
        if HAS_POS:
            masked = _near_document_start(last, U, K)
        if masked:
            positions = _positions(pos, starts + t0, spos_t, ends, U, HAS_POS)
            window_g, window_u = _swiglu_rows(
                y,
                rows_g,
                rows_u,
                positions,
                starts + t0,
                window_g,
                window_u,
                taps_g,
                taps_u,
                bias_g,
                bias_u,
                sy_t,
                ends,
                col_mask,
                K,
                U,
                HAS_BIAS,
                RESIDUAL and SILU,
                SILU,
                True,
            )
        else:
            window_g, window_u = _swiglu_rows(
                y,
                rows_g,
                rows_u,
                unmasked,
                starts + t0,
                window_g,
                window_u,
                taps_g,
                taps_u,
                bias_g,
                bias_u,
                sy_t,
                ends,
                col_mask,
                K,
                U,
                HAS_BIAS,
                RESIDUAL and SILU,
                SILU,
                False,
            )


@triton.jit
def _conv_backward_row(
    u,
    dy,
    window,
    pending,
    acc,
    db,
    res,
    taps_u,
    taps,
    bias,
    reach,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    STORE_DX: tl.constexpr,
    COL_GRAD: tl.constexpr,
    SUMS: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One row of ``_canon_bwd_kernel``'s walk: the input gradient row it completes, and the state
    one row on. With SUMS (a row of the run's own) the weight and bias sums take the row."""
    dz = dy
    if SILU:
        dz = dy * _silu_grad(_conv(u, window, taps_u, bias, reach, K, HAS_BIAS, MASKED))
    done = dz
    if STORE_DX:
        done, pending = _scatter(pending, dz, dy, taps, reach, K, RESIDUAL, MASKED)
    if SUMS:
        acc = _add_tap_terms(acc, dz, u, window, reach, K, MASKED)
        if HAS_BIAS:
            db += dz
        if COL_GRAD and RESIDUAL:
            res += dy * u
    return done, _shift(window, u, K), pending, acc, db, res


@triton.jit
def _conv_backward_rows(
    dx,
    dh,
    rows,
    scales,
    rows_dy,
    positions,
    first,
    starts,
    ends,
    lo,
    window,
    pending,
    acc,
    db,
    res,
    taps_u,
    taps,
    bias,
    sdx_t,
    sh_t,
    col_mask,
    K: tl.constexpr,
    U: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    SCALED: tl.constexpr,
    STORE_DX: tl.constexpr,
    COL_GRAD: tl.constexpr,
    HAS_HALO: tl.constexpr,
    MASKED: tl.constexpr,
):
    """U rows of ``_canon_bwd_kernel``'s walk from row ``first`` of each walk: the dx rows they
    complete stored (the halo's into ``dh``); the state after them."""
    for i in tl.static_range(U):
        done, window, pending, acc, db, res = _conv_backward_row(
            _input(rows[i], scales[i], SCALED),
            rows_dy[i].to(tl.float32),
            window,
            pending,
            acc,
            db,
            res,
            taps_u,
            taps,
            bias,
            positions[i],
            K,
            HAS_BIAS,
            RESIDUAL,
            SILU,
            STORE_DX,
            COL_GRAD,
            True,
            MASKED,
        )
        if STORE_DX:
            _store_rows(dx, first + i - (K - 1), sdx_t, starts, ends, col_mask, done)
            if HAS_HALO:
                _store_halo_rows(dh, first + i - (K - 1), sh_t, lo, starts, col_mask, done, K)
    return window, pending, acc, db, res


@triton.jit
def _canon_bwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    rs_ptr,
    cs_ptr,
    pos_ptr,
    halo_ptr,
    dy_ptr,
    dx_ptr,
    dh_ptr,
    dw_ptr,
    db_ptr,
    dcs_ptr,
    T,
    C,
    split,
    sx_b,
    sx_t,
    sx_c,
    srs_b,
    srs_t,
    spos_b,
    spos_t,
    sh_b,
    sh_t,
    sh_c,
    sdy_b,
    sdy_t,
    sdy_c,
    sdx_b,
    sdx_t,
    sdx_c,
    sw_c,
    sw_k,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_HALO: tl.constexpr,
    X_ALIGNED: tl.constexpr,
    STORE_DX: tl.constexpr,
    COL_GRAD: tl.constexpr,
    CHUNK: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    U: tl.constexpr,
):
    """dx (of the input the convolution saw: after the scales) with STORE_DX, and the weight and
    bias gradients' partial sums over the program's CHUNK rows, at [part, c, j] and [part, c]; with
    COL_GRAD (SCALED, no SiLU) the column scale's too. dz = dy, times SiLU's derivative at ``pre``
    with SiLU."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = (cols < C)[None, :]
    batch = tl.program_id(2).to(tl.int64)
    starts, ends, lo, end, walked, run = _walks(split, T, CHUNK, STREAMS)
    halo_offsets = batch * sh_b + run * (K - 1) * sh_t + cols[None, :] * sh_c
    dh = dh_ptr + halo_offsets
    x = x_ptr + batch * sx_b + cols[None, :] * sx_c
    dy = dy_ptr + batch * sdy_b + cols[None, :] * sdy_c
    dx = dx_ptr + batch * sdx_b + cols[None, :] * sdx_c
    rs = rs_ptr + batch * srs_b
    pos = pos_ptr + batch * spos_b
    sx_t = _row_stride(sx_t, X_ALIGNED)
    ones = tl.full([1, BLOCK_C], 1.0, tl.float32)
    cs = ones
    if SCALED:
        cs = tl.load(cs_ptr + cols[None, :], mask=col_mask, other=0.0).to(tl.float32)
    taps = _taps(w_ptr, cols[None, :], sw_c, sw_k, col_mask, ones, K, False)
    taps_u = _taps(w_ptr, cols[None, :], sw_c, sw_k, col_mask, cs, K, SCALED)
    if RESIDUAL and not SILU:  # dx and the column scale's gradient take the residual with the taps
        taps = _with_residual(taps, ones, K)
    bias = tl.zeros([1, BLOCK_C], tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols[None, :], mask=col_mask, other=0.0).to(tl.float32)
    zeros = tl.zeros([STREAMS, BLOCK_C], tl.float32)
    acc = _copies(zeros, K)
    pending = _copies(zeros, K - 1)
    db = zeros
    res = zeros
    window = _window(
        x,
        rs,
        halo_ptr + halo_offsets,
        starts,
        lo,
        end,
        sx_t,
        srs_t,
        sh_t,
        col_mask,
        K,
        SCALED,
        HAS_HALO,
    )
    ahead = _load_rows(x, rs, starts, sx_t, srs_t, ends, col_mask, U, SCALED)
    ahead_dy = _load_rows(dy, dy, starts, sdy_t, 0, ends, col_mask, U, False)
    ahead_last = _last_position(pos, starts, spos_t, ends, U, HAS_POS)
    unmasked = _copies(0, U)
    for t0 in range(0, walked, U):
        rows, scales = ahead
        rows_dy, _ = ahead_dy
        last = ahead_last
        ahead = _load_rows(x, rs, starts + t0 + U, sx_t, srs_t, ends, col_mask, U, SCALED)
        ahead_dy = _load_rows(dy, dy, starts + t0 + U, sdy_t, 0, ends, col_mask, U, False)
        ahead_last = _last_position(pos, starts + t0 + U, spos_t, ends, U, HAS_POS)
        masked = False
        if HAS_POS:
            masked = _near_document_start(last, U, K)
        if masked:
            positions = _positions(pos, starts + t0, spos_t, ends, U, HAS_POS)
            window, pending, acc, db, res = _conv_backward_rows(
                dx,
                dh,
                rows,
                scales,
                rows_dy,
                positions,
                starts + t0,
                starts,
                ends,
                lo,
                window,
                pending,
                acc,
                db,
                res,
                taps_u,
                taps,
                bias,
                sdx_t,
                sh_t,
                col_mask,
                K,
                U,
                HAS_BIAS,
                RESIDUAL and SILU,
                SILU,
                SCALED,
                STORE_DX,
                COL_GRAD,
                HAS_HALO,
                True,
            )
        else:
            window, pending, acc, db, res = _conv_backward_rows(
                dx,
                dh,
                rows,
                scales,
                rows_dy,
                unmasked,
                starts + t0,
                starts,
                ends,
                lo,
                window,
                pending,
                acc,
                db,
                res,
                taps_u,
                taps,
                bias,
                sdx_t,
                sh_t,
                col_mask,
                K,
                U,
                HAS_BIAS,
                RESIDUAL and SILU,
                SILU,
                SCALED,
                STORE_DX,
                COL_GRAD,
                HAS_HALO,
                False,
            )
    if STORE_DX:  # the K-1 rows after each walk complete its last rows' dx
        after = starts + tl.cdiv(walked, U) * U
        tail, scales = _load_rows(x, rs, after, sx_t, srs_t, end, col_mask, K - 1, SCALED)
        tail_dy, _ = _load_rows(dy, dy, after, sdy_t, 0, end, col_mask, K - 1, False)
        positions = _positions(pos, after, spos_t, end, K - 1, HAS_POS)
        for i in tl.static_range(K - 1):
            done, window, pending, acc, db, res = _conv_backward_row(
                _input(tail[i], scales[i], SCALED),
                tail_dy[i].to(tl.float32),
                window,
                pending,
                acc,
                db,
                res,
                taps_u,
                taps,
                bias,
                positions[i],
                K,
                HAS_BIAS,
                RESIDUAL and SILU,
                SILU,
                STORE_DX,
                COL_GRAD,
                False,
                HAS_POS,
            )
            _store_rows(dx, after + i - (K - 1), sdx_t, starts, ends, col_mask, done)
            if HAS_HALO:
                _store_halo_rows(dh, after + i - (K - 1), sh_t, lo, starts, col_mask, done, K)
    part = batch * tl.num_programs(0) + tl.program_id(0)
    _store_taps(dw_ptr, acc, part, C, cols, cols < C, tl.sum(cs, axis=0), K)
    if HAS_BIAS:
        tl.store(db_ptr + part * C + cols, tl.sum(db, axis=0), mask=cols < C)
    if (
        COL_GRAD
    ):  # d/dcs of input = u * cs: the residual's sum(dy * u), and sum_j w_j * sum(dz * u[j])
        dcs = res
        for j in tl.static_range(K):
            dcs += taps[j] * acc[j]
        tl.store(dcs_ptr + part * C + cols, tl.sum(dcs, axis=0), mask=cols < C)


@triton.jit
def _swiglu_backward_row(
    xg,
    xu,
    dy,
    state,
    taps_g,
    taps_u,
    bias_g,
    bias_u,
    reach,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    SUMS: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One row of ``_canon_swiglu_bwd_kernel``'s walk: the gate and up gradient rows it completes,
    and the state one row on (windows, pending input gradients, per-tap and bias sums, of gate and
    up)."""
    window_g, window_u, pending_g, pending_u, acc_g, acc_u, db_g, db_u = state
    pre_g = _conv(xg, window_g, taps_g, bias_g, reach, K, HAS_BIAS, MASKED)
    pre_u = _conv(xu, window_u, taps_u, bias_u, reach, K, HAS_BIAS, MASKED)
    gate = pre_g
    up = pre_u
    if SILU:
        gate = pre_g * _sigmoid(pre_g)
        up = pre_u * _sigmoid(pre_u)
    if RESIDUAL:
        gate += xg
        up += xu
    sig = _sigmoid(gate)
    dy_sig = dy * sig
    d_up = dy_sig * gate
    d_gate = up * (dy_sig + (d_up - d_up * sig))  # dy * silu'(gate): sig + silu * (1 - sig)
    dz_g = d_gate
    dz_u = d_up
    if SILU:
        dz_g = d_gate * _silu_grad(pre_g)
        dz_u = d_up * _silu_grad(pre_u)
    done_g, pending_g = _scatter(pending_g, dz_g, d_gate, taps_g, reach, K, RESIDUAL, MASKED)
    done_u, pending_u = _scatter(pending_u, dz_u, d_up, taps_u, reach, K, RESIDUAL, MASKED)
    if SUMS:
        acc_g = _add_tap_terms(acc_g, dz_g, xg, window_g, reach, K, MASKED)
        acc_u = _add_tap_terms(acc_u, dz_u, xu, window_u, reach, K, MASKED)
        if HAS_BIAS:
            db_g += dz_g
            db_u += dz_u
    state = (
        _shift(window_g, xg, K),
        _shift(window_u, xu, K),
        pending_g,
        pending_u,
        acc_g,
        acc_u,
        db_g,
        db_u,
    )
    return done_g, done_u, state


@triton.jit
def _swiglu_backward_rows(
    dg,
    du,
    dhg,
    dhu,
    rows_g,
    rows_u,
    rows_dy,
    positions,
    first,
    starts,
    ends,
    lo,
    state,
    taps_g,
    taps_u,
    bias_g,
    bias_u,
    sdx_t,
    sh_t,
    col_mask,
    K: tl.constexpr,
    U: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    HAS_HALO: tl.constexpr,
    MASKED: tl.constexpr,
):
    """U rows of ``_canon_swiglu_bwd_kernel``'s walk from row ``first`` of each run: the gate and up
    gradient rows they complete stored; the state after them."""
    for i in tl.static_range(U):
        done_g, done_u, state = _swiglu_backward_row(
            rows_g[i].to(tl.float32),
            rows_u[i].to(tl.float32),
            rows_dy[i].to(tl.float32),
            state,
            taps_g,
            taps_u,
            bias_g,
            bias_u,
            positions[i],
            K,
            HAS_BIAS,
            RESIDUAL,
            SILU,
            True,
            MASKED,
        )
        _store_rows(dg, first + i - (K - 1), sdx_t, starts, ends, col_mask, done_g)
        _store_rows(du, first + i - (K - 1), sdx_t, starts, ends, col_mask, done_u)
        if HAS_HALO:
            _store_halo_rows(dhg, first + i - (K - 1), sh_t, lo, starts, col_mask, done_g, K)
            _store_halo_rows(dhu, first + i - (K - 1), sh_t, lo, starts, col_mask, done_u, K)
    return state


@triton.jit
def _canon_swiglu_bwd_kernel(
    g_ptr,
    u_ptr,
    w_ptr,
    b_ptr,
    pos_ptr,
    hg_ptr,
    hu_ptr,
    dy_ptr,
    dg_ptr,
    du_ptr,
    dhg_ptr,
    dhu_ptr,
    dw_ptr,
    db_ptr,
    T,
    H,
    split,
    sg_b,
    sg_t: tl.constexpr,
    sg_c,
    su_b,
    su_t: tl.constexpr,
    su_c,
    spos_b,
    spos_t,
    sh_b,
    sh_t,
    sh_c,
    sdy_b,
    sdy_t: tl.constexpr,
    sdy_c,
    sdx_b,
    sdx_t: tl.constexpr,
    sdx_c,
    sw_c,
    sw_k,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_HALO: tl.constexpr,
    CHUNK: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    U: tl.constexpr,
):
    """Gradients of gate and up (dg, du: same strides) and the weight/bias partial sums over the
    program's CHUNK rows ([part, 2H, K], [part, 2H]). The row strides are compile-time constants
    (one compile per layout; a model's are fixed): fewer integer instructions a row
    (``SWIGLU_BACKWARD_BLOCKS``)."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = (cols < H)[None, :]
    batch = tl.program_id(2).to(tl.int64)
    starts, ends, lo, end, walked, run = _walks(split, T, CHUNK, STREAMS)
    halo_offsets = batch * sh_b + run * (K - 1) * sh_t + cols[None, :] * sh_c
    dhg = dhg_ptr + halo_offsets
    dhu = dhu_ptr + halo_offsets
    g = g_ptr + batch * sg_b + cols[None, :] * sg_c
    u = u_ptr + batch * su_b + cols[None, :] * su_c
    dy = dy_ptr + batch * sdy_b + cols[None, :] * sdy_c
    dg = dg_ptr + batch * sdx_b + cols[None, :] * sdx_c
    du = du_ptr + batch * sdx_b + cols[None, :] * sdx_c
    pos = pos_ptr + batch * spos_b
    ones = tl.full([1, BLOCK_C], 1.0, tl.float32)
    taps_g = _taps(w_ptr, cols[None, :], sw_c, sw_k, col_mask, ones, K, False)
    taps_u = _taps(w_ptr + H * sw_c, cols[None, :], sw_c, sw_k, col_mask, ones, K, False)
    if RESIDUAL and not SILU:
        taps_g = _with_residual(taps_g, ones, K)
        taps_u = _with_residual(taps_u, ones, K)
    bias_g = tl.zeros([1, BLOCK_C], tl.float32)
    bias_u = tl.zeros([1, BLOCK_C], tl.float32)
    if HAS_BIAS:
        bias_g = tl.load(b_ptr + cols[None, :], mask=col_mask, other=0.0).to(tl.float32)
        bias_u = tl.load(b_ptr + H + cols[None, :], mask=col_mask, other=0.0).to(tl.float32)
    zeros = tl.zeros([STREAMS, BLOCK_C], tl.float32)
    state = (
        _window(
            g,
            g,
            hg_ptr + halo_offsets,
            starts,
            lo,
            end,
            sg_t,
            0,
            sh_t,
            col_mask,
            K,
            False,
            HAS_HALO,
        ),
        _window(
            u,
            u,
            hu_ptr + halo_offsets,
            starts,
            lo,
            end,
            su_t,
            0,
            sh_t,
            col_mask,
            K,
            False,
            HAS_HALO,
        ),
        _copies(zeros, K - 1),
        _copies(zeros, K - 1),
        _copies(zeros, K),
        _copies(zeros, K),
        zeros,
        zeros,
    )
    ahead_g = _load_rows(g, g, starts, sg_t, 0, ends, col_mask, U, False)
    ahead_u = _load_rows(u, u, starts, su_t, 0, ends, col_mask, U, False)
    ahead_dy = _load_rows(dy, dy, starts, sdy_t, 0, ends, col_mask, U, False)
    ahead_last = _last_position(pos, starts, spos_t, ends, U, HAS_POS)
    unmasked = _copies(0, U)
    for t0 in tl.range(0, walked, U, loop_unroll_factor=2):
        rows_g, _ = ahead_g
        rows_u, _ = ahead_u
        rows_dy, _ = ahead_dy
        last = ahead_last
        ahead_g = _load_rows(g, g, starts + t0 + U, sg_t, 0, ends, col_mask, U, False)
        ahead_u = _load_rows(u, u, starts + t0 + U, su_t, 0, ends, col_mask, U, False)
        ahead_dy = _load_rows(dy, dy, starts + t0 + U, sdy_t, 0, ends, col_mask, U, False)
        ahead_last = _last_position(pos, starts + t0 + U, spos_t, ends, U, HAS_POS)
        masked = False
        if HAS_POS:
            masked = _near_document_start(last, U, K)
        if masked:
            positions = _positions(pos, starts + t0, spos_t, ends, U, HAS_POS)
            state = _swiglu_backward_rows(
                dg,
                du,
                dhg,
                dhu,
                rows_g,
                rows_u,
                rows_dy,
                positions,
                starts + t0,
                starts,
                ends,
                lo,
                state,
                taps_g,
                taps_u,
                bias_g,
                bias_u,
                sdx_t,
                sh_t,
                col_mask,
                K,
                U,
                HAS_BIAS,
                RESIDUAL and SILU,
                SILU,
                HAS_HALO,
                True,
            )
        else:
            state = _swiglu_backward_rows(
                dg,
                du,
                dhg,
                dhu,
                rows_g,
                rows_u,
                rows_dy,
                unmasked,
                starts + t0,
                starts,
                ends,
                lo,
                state,
                taps_g,
                taps_u,
                bias_g,
                bias_u,
                sdx_t,
                sh_t,
                col_mask,
                K,
                U,
                HAS_BIAS,
                RESIDUAL and SILU,
                SILU,
                HAS_HALO,
                False,
            )
    after = starts + tl.cdiv(walked, U) * U
    tail_g, _ = _load_rows(g, g, after, sg_t, 0, end, col_mask, K - 1, False)
    tail_u, _ = _load_rows(u, u, after, su_t, 0, end, col_mask, K - 1, False)
    tail_dy, _ = _load_rows(dy, dy, after, sdy_t, 0, end, col_mask, K - 1, False)
    positions = _positions(pos, after, spos_t, end, K - 1, HAS_POS)
    for i in tl.static_range(
        K - 1
    ):  # the K-1 rows after each run complete its last rows' gradients
        done_g, done_u, state = _swiglu_backward_row(
            tail_g[i].to(tl.float32),
            tail_u[i].to(tl.float32),
            tail_dy[i].to(tl.float32),
            state,
            taps_g,
            taps_u,
            bias_g,
            bias_u,
            positions[i],
            K,
            HAS_BIAS,
            RESIDUAL and SILU,
            SILU,
            False,
            HAS_POS,
        )
        _store_rows(dg, after + i - (K - 1), sdx_t, starts, ends, col_mask, done_g)
        _store_rows(du, after + i - (K - 1), sdx_t, starts, ends, col_mask, done_u)
        if HAS_HALO:
            _store_halo_rows(dhg, after + i - (K - 1), sh_t, lo, starts, col_mask, done_g, K)
            _store_halo_rows(dhu, after + i - (K - 1), sh_t, lo, starts, col_mask, done_u, K)
    _, _, _, _, acc_g, acc_u, db_g, db_u = state
    part = batch * tl.num_programs(0) + tl.program_id(0)
    _store_taps(dw_ptr, acc_g, part, 2 * H, cols, cols < H, 1.0, K)
    _store_taps(dw_ptr, acc_u, part, 2 * H, cols + H, cols < H, 1.0, K)
    if HAS_BIAS:
        tl.store(db_ptr + part * 2 * H + cols, tl.sum(db_g, axis=0), mask=cols < H)
        tl.store(db_ptr + part * 2 * H + H + cols, tl.sum(db_u, axis=0), mask=cols < H)


def _split(seq_len: int, split: int) -> int:
    """The kernels' split of the rows into two sequence runs: [0, split) and [split, seq_len)."""
    return seq_len if split < 0 else split


def _chunks(seq_len: int, split: int, rows: int) -> int:
    """Chunks of ``rows`` rows in the runs [0, split) and [split, seq_len), one program each."""
    split = _split(seq_len, split)
    return triton.cdiv(split, rows) + triton.cdiv(seq_len - split, rows)


def _grid(batch: int, seq_len: int, channels: int, split: int, rows: int | None = None):
    return lambda meta: (
        _chunks(seq_len, split, rows or meta["CHUNK"]),
        triton.cdiv(channels, meta["BLOCK_C"]),
        batch,
    )


def _partials(parts: int, kernel: int, channels: int, like: torch.Tensor, bias: bool):
    """fp32 partial sums of dw [parts, channels, K] and, with a bias, db [parts, channels]; without
    one db's pointer is dw's, never written."""
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


def _position_args(positions, weight) -> tuple:
    """Kernel arguments of the optional document positions: pointer and strides."""
    if positions is None:
        return weight, 0, 0
    return positions, *positions.stride()


def _halo_args(halo, like) -> tuple:
    """Kernel arguments of the optional halo rows : the tensor and its strides."""
    if halo is None:
        return like, 0, 0, 0
    return halo, *halo.stride()


# ----------------------------------------------------------------------------- ops
#
# Each op is a ``torch.library.triton_op``: its body allocates the outputs and launches the kernels
# through ``wrap_triton``; its fake is the body itself, traced. Under torch.compile Inductor traces
# the body into the block's graph and launches the kernels from its own generated code (no Python
# frame of the op per call; the weight-gradient sums become Inductor kernels). Under Triton's
# interpreter (``TRITON_INTERPRET=1``, the CPU tests) the same registration runs: the fake runs
# the body without launching anything, and a compiled graph keeps the ops whole (torch cannot
# trace a kernel that the interpreter runs), so only the GPU path decomposes them.


if INTERPRETED:
    import torch._functorch.config
    from torch._subclasses.fake_tensor import FakeTensor

    torch._functorch.config.decompose_custom_triton_ops = False

    class _InterpretedLaunch:
        """``kernel[grid](*args)`` run by the interpreter, except on fake tensors (the op's
        fake) and meta tensors (a planned step: shapes only, nothing to compute)."""

        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if not any(
                    isinstance(a, FakeTensor) or (isinstance(a, torch.Tensor) and a.is_meta)
                    for a in args
                ):
                    self.kernel[grid](*args, **kwargs)

            return launch

    wrap_triton = _InterpretedLaunch
else:
    wrap_triton = torch.library.wrap_triton


def _op(name: str):
    return lambda fn: torch.library.triton_op(name, fn, mutates_args=())


def conv_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    col_scale: torch.Tensor | None,
    residual: bool,
    activation: bool,
    positions: torch.Tensor | None = None,
    halo: torch.Tensor | None = None,
    split: int = -1,
) -> torch.Tensor:
    batch, seq_len, channels = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rs, cs, srs_b, srs_t = _scale_args(row_scale, col_scale, weight)
    pos, spos_b, spos_t = _position_args(positions, weight)
    halo, *halo_strides = _halo_args(halo, weight)
    wrap_triton(_canon_fwd_kernel)[_grid(batch, seq_len, channels, split)](
        x,
        weight,
        _bias_ptr(bias, weight),
        rs,
        cs,
        pos,
        halo,
        y,
        seq_len,
        channels,
        _split(seq_len, split),
        *x.stride(),
        srs_b,
        srs_t,
        spos_b,
        spos_t,
        *halo_strides,
        *y.stride(),
        *weight.stride(),
        K=weight.shape[1],
        HAS_BIAS=bias is not None,
        RESIDUAL=residual,
        SILU=activation,
        SCALED=row_scale is not None,
        HAS_POS=positions is not None,
        HAS_HALO=halo is not weight,
        X_ALIGNED=_rows_aligned(x),
        **_forward_launch(),
    )
    return y


def _conv_backward(
    dy,
    x,
    weight,
    bias,
    row_scale,
    col_scale,
    residual: bool,
    activation: bool,
    positions,
    halo,
    split: int,
    input_grad: bool,
):
    """The backward kernel's launch: dx and the halo rows' (of the input the convolution saw, after
    the scales) unless ``input_grad`` is off (then, with the scales, the column scale's gradient
    instead), and the weight/bias gradients."""
    batch, seq_len, channels = x.shape
    kernel, rows = weight.shape[1], _chunk_rows(batch, seq_len, channels, BACKWARD_BLOCKS)
    parts = batch * _chunks(seq_len, split, rows)
    # Without the input's gradient, empty tensors stand for dx and the halo's (never written;
    # Inductor would copy larger stand-ins, as the kernel's stores to them count as a mutation of
    # whatever tensor is passed).
    dx = x.new_empty(x.shape if input_grad else (0, 0, 0))
    d_halo = torch.empty(
        halo.shape if input_grad and halo is not None else (0, 0, 0), dtype=x.dtype, device=x.device
    )
    partial_dw, partial_db = _partials(parts, kernel, channels, x, bias is not None)
    col_grad = row_scale is not None and not input_grad
    partial_dcs = (
        torch.empty(parts, channels, dtype=torch.float32, device=x.device)
        if col_grad
        else partial_dw
    )
    rs, cs, srs_b, srs_t = _scale_args(row_scale, col_scale, weight)
    pos, spos_b, spos_t = _position_args(positions, weight)
    halo, *halo_strides = _halo_args(halo, weight)
    wrap_triton(_canon_bwd_kernel)[_grid(batch, seq_len, channels, split, rows)](
        x,
        weight,
        _bias_ptr(bias, weight),
        rs,
        cs,
        pos,
        halo,
        dy,
        dx,
        d_halo,
        partial_dw,
        partial_db,
        partial_dcs,
        seq_len,
        channels,
        _split(seq_len, split),
        *x.stride(),
        srs_b,
        srs_t,
        spos_b,
        spos_t,
        *halo_strides,
        *dy.stride(),
        *dx.stride(),
        *weight.stride(),
        K=kernel,
        HAS_BIAS=bias is not None,
        RESIDUAL=residual,
        SILU=activation,
        SCALED=row_scale is not None,
        HAS_POS=positions is not None,
        HAS_HALO=halo is not weight,
        X_ALIGNED=_rows_aligned(x),
        STORE_DX=input_grad,
        COL_GRAD=col_grad,
        **_backward_blocks(channels, rows, BACKWARD_BLOCKS),
    )
    dw, db = _weight_grads(partial_dw, partial_db, weight, bias)
    if col_grad:
        return partial_dcs.sum(0).to(col_scale.dtype), dw, db
    return dx, dw, db, d_halo


def conv_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    col_scale: torch.Tensor | None,
    residual: bool,
    activation: bool,
    positions: torch.Tensor | None = None,
    halo: torch.Tensor | None = None,
    split: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the convolution's input (after scaling), weight, bias (empty without one) and
    halo rows (after scaling; empty without them)."""
    return _conv_backward(
        dy,
        x,
        weight,
        bias,
        row_scale,
        col_scale,
        residual,
        activation,
        positions,
        halo,
        split,
        input_grad=True,
    )


def conv_weight_grads(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    residual: bool,
    positions: torch.Tensor | None = None,
    halo: torch.Tensor | None = None,
    split: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Without SiLU, on a scaled input: the gradients of the column scale, the weight and the bias,
    and not the input's, which ``_canon_conv_grad`` leaves to torch ops."""
    return _conv_backward(
        dy,
        x,
        weight,
        bias,
        row_scale,
        col_scale,
        residual,
        False,
        positions,
        halo,
        split,
        input_grad=False,
    )


def swiglu_forward(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: bool,
    activation: bool,
    positions: torch.Tensor | None = None,
    halo_gate: torch.Tensor | None = None,
    halo_up: torch.Tensor | None = None,
    split: int = -1,
) -> torch.Tensor:
    batch, seq_len, hidden = gate.shape
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    pos, spos_b, spos_t = _position_args(positions, weight)
    halo_gate, *halo_strides = _halo_args(halo_gate, weight)
    halo_up, _, _, _ = _halo_args(halo_up, weight)
    wrap_triton(_canon_swiglu_fwd_kernel)[_grid(batch, seq_len, hidden, split)](
        gate,
        up,
        weight,
        _bias_ptr(bias, weight),
        pos,
        halo_gate,
        halo_up,
        y,
        seq_len,
        hidden,
        _split(seq_len, split),
        *gate.stride(),
        *up.stride(),
        spos_b,
        spos_t,
        *halo_strides,
        *y.stride(),
        *weight.stride(),
        K=weight.shape[1],
        HAS_BIAS=bias is not None,
        RESIDUAL=residual,
        SILU=activation,
        HAS_POS=positions is not None,
        HAS_HALO=halo_gate is not weight,
        **_forward_launch(),
    )
    return y


def swiglu_backward(
    dy: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: bool,
    activation: bool,
    positions: torch.Tensor | None = None,
    halo_gate: torch.Tensor | None = None,
    halo_up: torch.Tensor | None = None,
    split: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of gate, up, the weight, the bias (empty without one) and the halo rows of gate and
    up (empty without them)."""
    batch, seq_len, hidden = gate.shape
    kernel = weight.shape[1]
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    halo_shape = halo_gate.shape if halo_gate is not None else (0, 0, 0)
    d_halo_gate = torch.empty(halo_shape, dtype=gate.dtype, device=gate.device)
    d_halo_up = torch.empty(halo_shape, dtype=gate.dtype, device=gate.device)
    rows = _chunk_rows(batch, seq_len, hidden, SWIGLU_BACKWARD_BLOCKS)
    partial_dw, partial_db = _partials(
        batch * _chunks(seq_len, split, rows), kernel, 2 * hidden, gate, bias is not None
    )
    pos, spos_b, spos_t = _position_args(positions, weight)
    halo_gate, *halo_strides = _halo_args(halo_gate, weight)
    halo_up, _, _, _ = _halo_args(halo_up, weight)
    wrap_triton(_canon_swiglu_bwd_kernel)[_grid(batch, seq_len, hidden, split, rows)](
        gate,
        up,
        weight,
        _bias_ptr(bias, weight),
        pos,
        halo_gate,
        halo_up,
        dy,
        d_gate,
        d_up,
        d_halo_gate,
        d_halo_up,
        partial_dw,
        partial_db,
        seq_len,
        hidden,
        _split(seq_len, split),
        *gate.stride(),
        *up.stride(),
        spos_b,
        spos_t,
        *halo_strides,
        *dy.stride(),
        *d_gate.stride(),
        *weight.stride(),
        K=kernel,
        HAS_BIAS=bias is not None,
        RESIDUAL=residual,
        SILU=activation,
        HAS_POS=positions is not None,
        HAS_HALO=halo_gate is not weight,
        **_backward_blocks(hidden, rows, SWIGLU_BACKWARD_BLOCKS),
    )
    return (
        d_gate,
        d_up,
        *_weight_grads(partial_dw, partial_db, weight, bias),
        d_halo_gate,
        d_halo_up,
    )


_canon_conv_op = _op("canon_titan::canon_conv")(conv_forward)
_op("canon_titan::canon_conv_backward")(conv_backward)
_op("canon_titan::canon_conv_weight_grads")(conv_weight_grads)
_canon_swiglu_op = _op("canon_titan::canon_swiglu")(swiglu_forward)
_op("canon_titan::canon_swiglu_backward")(swiglu_backward)


def _canon_conv_setup(ctx, inputs, output):
    (
        x,
        weight,
        bias,
        row_scale,
        col_scale,
        ctx.residual,
        ctx.activation,
        positions,
        halo,
        ctx.split,
    ) = inputs
    ctx.save_for_backward(x, weight, bias, row_scale, col_scale, positions, halo)


def _transposed_conv(
    dy: torch.Tensor, weight: torch.Tensor, residual: bool, positions, split: int = -1
):
    """The gradient of the convolution's input without SiLU, in float32: ``dy[t] (residual) + sum_d
    w[K-1-d] dy[t+d]`` (zeros past the last token and the first run's end; with positions, where
    ``positions[t+d] >= d``)."""
    kernel, seq_len = weight.shape[-1], dy.shape[1]
    dy, weight = dy.float(), weight.float()
    padded = F.pad(dy, (0, 0, 0, kernel - 1))
    if positions is not None:
        reach = F.pad(positions, (0, kernel - 1))
    rows = torch.arange(seq_len, device=dy.device)
    d_input = dy * (weight[:, kernel - 1] + 1) if residual else dy * weight[:, kernel - 1]
    for d in range(1, kernel):
        later = padded[:, d : d + seq_len]
        if positions is not None:
            later = later.masked_fill((reach[:, d : d + seq_len] < d).unsqueeze(-1), 0)
        if split >= 0:  # row t+d is in the other run
            later = later.masked_fill(((rows < split) & (rows + d >= split)).unsqueeze(-1), 0)
        d_input = d_input + later * weight[:, kernel - 1 - d]
    return d_input


def _halo_grad(dy: torch.Tensor, weight: torch.Tensor, positions, split: int) -> torch.Tensor:
    """Without SiLU, the gradient of the halo rows (float32, as the convolution saw them): each
    run's first K-1 rows' ``dy`` carried back to the K-1 rows before it."""
    k, seq_len = weight.shape[-1] - 1, dy.shape[1]
    bounds = [0, split, seq_len] if split >= 0 else [0, seq_len]
    grads = []
    for start, end in zip(bounds, bounds[1:]):
        head = F.pad(dy[:, start : min(start + k, end)], (0, 0, k, k - min(k, end - start)))
        head_positions = None
        if positions is not None:
            head_positions = F.pad(
                positions[:, start : min(start + k, end)], (k, k - min(k, end - start))
            )
        grads.append(_transposed_conv(head, weight, False, head_positions)[:, :k])
    return torch.cat(grads, dim=1)


def _canon_conv_grad(ctx, dy):
    x, weight, bias, row_scale, col_scale, positions, halo = ctx.saved_tensors
    ops = torch.ops.canon_titan
    if row_scale is None or ctx.activation:
        d_input, dw, db, d_halo = ops.canon_conv_backward(
            dy,
            x,
            weight,
            bias,
            row_scale,
            col_scale,
            ctx.residual,
            ctx.activation,
            positions,
            halo,
            ctx.split,
        )
        d_col = None
    else:
        # A fused norm (Canon-A/C, Canon-B on q and k): the kernel reads x and dy once for the
        # weight's and the column scale's gradients, and the input's is left to torch ops, which
        # Inductor fuses with the norm's chain rule below and its backward into one pass that reads
        # dy and x and writes dx, as Llama's RMSNorm backward reads its input's gradient and x.
        d_col, dw, db = ops.canon_conv_weight_grads(
            dy, x, weight, bias, row_scale, col_scale, ctx.residual, positions, halo, ctx.split
        )
        d_input = _transposed_conv(dy, weight, ctx.residual, positions, ctx.split)
        d_halo = _halo_grad(dy, weight, positions, ctx.split) if halo is not None else None
    db = db if bias is not None else None
    if row_scale is None:
        return (
            d_input,
            dw,
            db,
            None,
            None,
            None,
            None,
            None,
            d_halo if halo is not None else None,
            None,
        )
    # input = x * row_scale * col_scale, in float32 (traced: Inductor fuses these into one pass);
    # the halo rows are x * row_scale already.
    d_input, xf, cs = d_input.float(), x.float(), col_scale.float()
    dx = (d_input * row_scale.unsqueeze(-1) * cs).to(x.dtype)
    d_row = (d_input * xf * cs).sum(-1).to(row_scale.dtype)
    if d_col is None:
        d_col = (d_input * xf * row_scale.unsqueeze(-1)).sum((0, 1))
        if halo is not None:
            d_col = d_col + (d_halo.float() * halo.float()).sum((0, 1))
        d_col = d_col.to(col_scale.dtype)
    d_halo = (d_halo.float() * cs).to(halo.dtype) if halo is not None else None
    return dx, dw, db, d_row, d_col, None, None, None, d_halo, None


_canon_conv_op.register_autograd(_canon_conv_grad, setup_context=_canon_conv_setup)


def _canon_swiglu_setup(ctx, inputs, output):
    (
        gate,
        up,
        weight,
        bias,
        ctx.residual,
        ctx.activation,
        positions,
        halo_gate,
        halo_up,
        ctx.split,
    ) = inputs
    ctx.save_for_backward(gate, up, weight, bias, positions, halo_gate, halo_up)


def _canon_swiglu_grad(ctx, dy):
    gate, up, weight, bias, positions, halo_gate, halo_up = ctx.saved_tensors
    d_gate, d_up, dw, db, d_halo_gate, d_halo_up = torch.ops.canon_titan.canon_swiglu_backward(
        dy,
        gate,
        up,
        weight,
        bias,
        ctx.residual,
        ctx.activation,
        positions,
        halo_gate,
        halo_up,
        ctx.split,
    )
    if halo_gate is None:
        d_halo_gate = d_halo_up = None
    return (
        d_gate,
        d_up,
        dw,
        db if bias is not None else None,
        None,
        None,
        None,
        d_halo_gate,
        d_halo_up,
        None,
    )


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
    halo: torch.Tensor | None = None,
    split: int = -1,
    backend: str = "torch",
) -> torch.Tensor:
    """x [B, T, C], weight [C, K] (index K-1 on the current token), bias [C] or None.

    With ``row_scale`` [B, T] and ``col_scale`` [C] the layer's input is ``x * row_scale *
    col_scale`` computed in float32 (an RMSNorm fused in: its inverse RMS and weight): the torch
    backend rounds it to x's dtype as RMSNorm does, the Triton kernels keep it in float32 and never
    store it.

    With ``positions`` [B, T] (each token's position in its document, 0 at a document's first token)
    the tap reaching back s rows adds to ``out[b, t]`` only where ``positions[b, t] >= s``: packed
    documents are convolved as if each were alone.

    With ``halo`` [B, R * (K-1), C] (context parallelism: a rank's rows are R <= 2 runs of the
    sequence, [0, split) and [split, T), ``split`` -1 for one) the taps that reach back past a run's
    start read that run's K-1 halo rows (before the column scale: x's dtype, or ``x * row_scale`` in
    float32 with the scales) instead of zeros.
    """
    if (row_scale is None) != (col_scale is None):
        raise ValueError("canon_conv: row_scale and col_scale go together")
    if _use_triton(backend, x, weight.shape[-1]):
        return torch.ops.canon_titan.canon_conv(
            x, weight, bias, row_scale, col_scale, residual, activation, positions, halo, split
        )
    if row_scale is not None:
        x = (x.float() * row_scale.unsqueeze(-1) * col_scale.float()).type_as(x)
        halo = (halo.float() * col_scale.float()).type_as(x) if halo is not None else None
    return _canon_torch(x, weight, bias, residual, activation, positions, halo, split)


def canon_swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: bool = True,
    activation: bool = False,
    positions: torch.Tensor | None = None,
    halo: tuple[torch.Tensor, torch.Tensor] | None = None,
    split: int = -1,
    backend: str = "torch",
) -> torch.Tensor:
    """``silu(canon(gate)) * canon(up)`` with weight [2H, K] over [gate | up] (gate, up: [B, T, H]);
    ``positions`` as in ``canon_conv``, ``halo`` the halo rows of gate and up (as in
    ``canon_conv``)."""
    halo_gate, halo_up = halo if halo is not None else (None, None)
    if _use_triton(backend, gate, weight.shape[-1]):
        return torch.ops.canon_titan.canon_swiglu(
            gate, up, weight, bias, residual, activation, positions, halo_gate, halo_up, split
        )
    hidden = gate.shape[-1]
    w_gate, w_up = weight.split(hidden)
    b_gate, b_up = bias.split(hidden) if bias is not None else (None, None)
    gate = _canon_torch(gate, w_gate, b_gate, residual, activation, positions, halo_gate, split)
    return F.silu(gate) * _canon_torch(
        up, w_up, b_up, residual, activation, positions, halo_up, split
    )
