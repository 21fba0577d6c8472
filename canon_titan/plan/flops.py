"""FLOP formulas for the ops PyTorch's ``FlopCounterMode`` does not know, registered with its
``register_flop_formula``: canon-titan's custom ops (the Canon convolution, GLA, the gated delta
rule, the Mamba2 SSD) and the CPU flash-attention op, which a plan on fake CPU tensors dispatches
where a GPU run calls the CUDA flash kernel. Each counts a multiply-add as 2 FLOPs, as PyTorch's
formulas do; a backward counts what its kernel computes.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import (
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

import canon_titan.kernels.canon  # noqa: F401  (the kernel modules define the custom ops)
import canon_titan.kernels.delta_rule  # noqa: F401
import canon_titan.kernels.gla  # noqa: F401
import canon_titan.kernels.ssd  # noqa: F401

aten, ops = torch.ops.aten, torch.ops.canon_titan

MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm}
ATTENTION = {
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_cudnn_attention_backward,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._flash_attention_forward,
    aten._flash_attention_backward,
}
CANON = {
    ops.canon_conv,
    ops.canon_conv_backward,
    ops.canon_conv_weight_grads,
    ops.canon_swiglu,
    ops.canon_swiglu_backward,
}
RECURRENCES = {
    ops.fla_chunk_gla,
    ops.fla_chunk_gla_backward,
    ops.fla_chunk_gated_delta_rule,
    ops.fla_chunk_gated_delta_rule_backward,
    ops.mamba_chunk_scan,
    ops.mamba_chunk_scan_backward,
}
# With document boundaries (kernels/documents.py): the same kernels, the same work.
RECURRENCES |= {
    ops.fla_chunk_gla_documents,
    ops.fla_chunk_gla_documents_backward,
    ops.fla_chunk_gated_delta_rule_documents,
    ops.fla_chunk_gated_delta_rule_documents_backward,
    ops.mamba_chunk_scan_documents,
    ops.mamba_chunk_scan_documents_backward,
}


def op_kind(packet) -> str:
    """The op's kind; a custom op of canon-titan by its name too (``canon_*``: the Canon op's,
    ``fla_*``, ``mamba_*``: the recurrences'), so that a new kernel's op is priced by its
    kernels."""
    if packet in MATMULS:
        return "matmul"
    if packet in ATTENTION:
        return "attention"
    name = str(packet)
    if packet in CANON or name.startswith("canon_titan.canon_"):
        return "canon"
    if packet in RECURRENCES or name.startswith(("canon_titan.fla_", "canon_titan.mamba_")):
        return "recurrence"
    return "other"


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _cpu_sdpa_backward(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# Canon: a depthwise causal convolution of K taps over [B, T, C]: 2 K FLOPs per element forward;
# the backward computes the input gradient and the weight gradient, 2 K each.
@register_flop_formula(ops.canon_conv)
def _canon(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(x_shape) * weight_shape[-1]


@register_flop_formula(ops.canon_conv_backward)
def _canon_backward(dy_shape, x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 4 * math.prod(x_shape) * weight_shape[-1]


@register_flop_formula(ops.canon_conv_weight_grads)
def _canon_weight_grads(dy_shape, x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    # the weight gradient, and the input gradient that the column scale's needs (the input's own is
    # torch's)
    return 4 * math.prod(x_shape) * weight_shape[-1]


@register_flop_formula(ops.canon_swiglu)
def _canon_swiglu(gate_shape, up_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * 2 * math.prod(gate_shape) * weight_shape[-1]


@register_flop_formula(ops.canon_swiglu_backward)
def _canon_swiglu_backward(
    dy_shape, gate_shape, up_shape, weight_shape, *args, out_shape=None, **kwargs
) -> int:
    return 4 * 2 * math.prod(gate_shape) * weight_shape[-1]


def _gla_forward(q_shape, v_shape, chunk: int) -> int:
    """Chunked GLA: scores and their product with v inside each chunk, the state's contribution to
    every query and every key's update of the state."""
    batch, seq_len, heads, dk = q_shape
    dv = v_shape[-1]
    return 2 * batch * heads * seq_len * (chunk * (dk + dv) + 2 * dk * dv)


def _gla_chunk(seq_len: int) -> int:
    from canon_titan.kernels.gla import _fla_chunk_size

    return _fla_chunk_size(seq_len)


@register_flop_formula(ops.fla_chunk_gla)
def _gla(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return _gla_forward(q_shape, v_shape, _gla_chunk(q_shape[1]))


@register_flop_formula(ops.fla_chunk_gla_backward)
def _gla_backward(
    do_shape, d_final_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs
) -> int:
    # The gradients of every product above (twice the forward), plus the states recomputed.
    batch, seq_len, heads, dk = q_shape
    return (
        2 * _gla_forward(q_shape, v_shape, _gla_chunk(seq_len))
        + 2 * batch * heads * seq_len * dk * v_shape[-1]
    )


def _delta_rule_forward(q_shape, v_shape) -> int:
    """Chunked gated delta rule (WY form): the chunk's K K^T and its triangular solve applied to
    beta k and beta v, then GLA-like scores, and the state read twice (queries, keys) and
    updated."""
    from canon_titan.kernels.delta_rule import FLA_CHUNK_SIZE as chunk

    batch, seq_len, heads, dk = q_shape
    dv = v_shape[-1]
    return 2 * batch * heads * seq_len * (3 * chunk * dk + 2 * chunk * dv + 3 * dk * dv)


@register_flop_formula(ops.fla_chunk_gated_delta_rule)
def _delta_rule(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return _delta_rule_forward(q_shape, v_shape)


@register_flop_formula(ops.fla_chunk_gated_delta_rule_backward)
def _delta_rule_backward(
    do_shape, d_final_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs
) -> int:
    batch, seq_len, heads, dk = q_shape
    return (
        2 * _delta_rule_forward(q_shape, v_shape) + 2 * batch * heads * seq_len * dk * v_shape[-1]
    )


def _ssd_forward(x_shape, b_shape, chunk: int) -> int:
    """Mamba2 SSD: C B^T inside each chunk (per group), its product with x (per head), the chunk
    states x^T B and their contribution C h to the outputs."""
    batch, seq_len, heads, head_dim = x_shape
    groups, state = b_shape[2], b_shape[3]
    return (
        2
        * batch
        * seq_len
        * (groups * chunk * state + heads * (chunk * head_dim + 2 * head_dim * state))
    )


@register_flop_formula(ops.mamba_chunk_scan)
def _ssd(
    x_shape,
    dt_shape,
    a_shape,
    b_shape,
    c_shape,
    d_shape,
    h0_shape,
    chunk_size,
    *args,
    out_shape=None,
    **kwargs,
) -> int:
    return _ssd_forward(x_shape, b_shape, chunk_size)


@register_flop_formula(ops.mamba_chunk_scan_backward)
def _ssd_backward(
    dy_shape,
    d_final_shape,
    x_shape,
    dt_shape,
    a_shape,
    b_shape,
    c_shape,
    d_shape,
    h0_shape,
    y_shape,
    chunk_size,
    *args,
    out_shape=None,
    **kwargs,
) -> int:
    batch, seq_len, heads, head_dim = x_shape
    return (
        2 * _ssd_forward(x_shape, b_shape, chunk_size)
        + 2 * batch * seq_len * heads * head_dim * b_shape[3]
    )


# With document boundaries the kernels run over the same chunks of the same tokens (the batch
# flattened for fla: one row of 64-token chunks, each document's last one partial), so the formulas
# above count their work at FLA_CHUNK; a document's partial chunk costs as a full one.
@register_flop_formula(ops.fla_chunk_gla_documents)
def _gla_documents(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    from canon_titan.kernels.documents import FLA_CHUNK

    return _gla_forward(q_shape, v_shape, FLA_CHUNK)


@register_flop_formula(ops.fla_chunk_gla_documents_backward)
def _gla_documents_backward(
    do_shape, d_final_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs
) -> int:
    from canon_titan.kernels.documents import FLA_CHUNK

    batch, seq_len, heads, dk = q_shape
    states = 2 * batch * heads * seq_len * dk * v_shape[-1]
    return 2 * _gla_forward(q_shape, v_shape, FLA_CHUNK) + states


@register_flop_formula(ops.fla_chunk_gated_delta_rule_documents)
def _delta_rule_documents(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return _delta_rule_forward(q_shape, v_shape)


@register_flop_formula(ops.fla_chunk_gated_delta_rule_documents_backward)
def _delta_rule_documents_backward(
    do_shape, d_final_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs
) -> int:
    return _delta_rule_backward(do_shape, d_final_shape, q_shape, k_shape, v_shape)


@register_flop_formula(ops.mamba_chunk_scan_documents)
def _ssd_documents(
    x_shape,
    dt_shape,
    a_shape,
    b_shape,
    c_shape,
    d_shape,
    chunk_size,
    *args,
    out_shape=None,
    **kwargs,
) -> int:
    return _ssd_forward(x_shape, b_shape, chunk_size)


@register_flop_formula(ops.mamba_chunk_scan_documents_backward)
def _ssd_documents_backward(
    dy_shape,
    d_final_shape,
    x_shape,
    dt_shape,
    a_shape,
    b_shape,
    c_shape,
    d_shape,
    y_shape,
    chunk_size,
    *args,
    out_shape=None,
    **kwargs,
) -> int:
    batch, seq_len, heads, head_dim = x_shape
    states = 2 * batch * seq_len * heads * head_dim * b_shape[3]
    return 2 * _ssd_forward(x_shape, b_shape, chunk_size) + states
