"""Canon layer: a causal depthwise convolution along the sequence, with a residual connection.

``out[t, c] = x[t, c] + sum_j w[c, 0, j] * x[t - (K-1) + j, c]`` (+ bias, optional SiLU before the
residual), with zeros before the first token: weight index ``K-1`` multiplies the current token.
The weight is ``[C, 1, K]`` like ``nn.Conv1d(C, C, K, groups=C)`` and keeps PyTorch's default
conv initialisation (uniform in +-1/sqrt(K), std ~0.289 for K=4); re-initialising it to a small
std hurts (PhysicsLM4).

Backends: ``torch`` (K shifted multiply-adds in [batch, seq, channel] layout: no transposes, 1.5x
faster than a grouped ``F.conv1d`` on CPU, fuses into one kernel under compile) and
``causal_conv1d`` (the CUDA kernel of the causal-conv1d package, K in 2..4). ``auto`` resolves to
``causal_conv1d`` when that package imports and CUDA is available, else ``torch``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.protocols.module import Module

from canon_titan.models.tensor_parallel import ChannelShard, local

CANON_POSITIONS = "ABCD"
FAST_KERNEL_SIZES = (2, 3, 4)


@functools.cache
def causal_conv1d_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import causal_conv1d  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(requested: str, kernel_size: int) -> str:
    if requested == "torch":
        return "torch"
    fast_ok = causal_conv1d_available() and kernel_size in FAST_KERNEL_SIZES
    if requested == "causal_conv1d":
        if not fast_ok:
            raise ValueError(
                "canon_backend 'causal_conv1d' needs a CUDA GPU, the causal-conv1d package "
                f"(pip install canon-titan[gpu]) and canon_kernel in {FAST_KERNEL_SIZES}"
            )
        return "causal_conv1d"
    return "causal_conv1d" if fast_ok else "torch"


def canon_weight_init(weight: torch.Tensor) -> None:
    """``nn.Conv1d``'s default: kaiming-uniform with a=sqrt(5), i.e. U(-1/sqrt(K), 1/sqrt(K))."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def canon_bias_init(bias: torch.Tensor, kernel_size: int) -> None:
    bound = 1 / math.sqrt(kernel_size)
    nn.init.uniform_(bias, -bound, bound)


@torch.compiler.disable
def _causal_conv1d_cuda(x_bct: torch.Tensor, weight: torch.Tensor, bias, activation: bool) -> torch.Tensor:
    from causal_conv1d import causal_conv1d_fn

    return causal_conv1d_fn(x_bct, weight, bias, activation="silu" if activation else None)


class CanonConv(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        channels: int
        kernel_size: int = 4
        residual: bool = True
        activation: bool = False
        """SiLU after the convolution (before the residual)."""
        bias: bool = False
        backend: Literal["torch", "causal_conv1d"] = "torch"

    def __init__(self, config: Config):
        super().__init__()
        self.kernel_size = config.kernel_size
        self.residual, self.activation, self.backend = config.residual, config.activation, config.backend
        self.weight = nn.Parameter(torch.empty(config.channels, 1, config.kernel_size))
        self.bias = nn.Parameter(torch.empty(config.channels)) if config.bias else None
        # Set by tensor parallelism for Canon-B/D, whose channels follow column-sharded projections.
        self.channel_shard: ChannelShard | None = None

    def reset_parameters(self) -> None:
        canon_weight_init(self.weight)
        if self.bias is not None:
            canon_bias_init(self.bias, self.kernel_size)

    def conv(self, x: torch.Tensor) -> torch.Tensor:
        """The causal convolution alone (no residual); x is [batch, seq, channels]."""
        weight, bias = local(self.weight, x), local(self.bias, x)
        if self.channel_shard is not None:
            weight = self.channel_shard.rows(weight)
            bias = self.channel_shard.rows(bias) if bias is not None else None
        weight = weight.squeeze(1)
        if self.backend == "causal_conv1d" and x.is_cuda:
            y = _causal_conv1d_cuda(x.transpose(1, 2).contiguous(), weight, bias, self.activation)
            return y.transpose(1, 2)
        k, seq_len = self.kernel_size, x.shape[1]
        padded = F.pad(x, (0, 0, k - 1, 0))
        y = x * weight[:, k - 1]
        for j in range(k - 1):
            y = y + padded[:, j : j + seq_len] * weight[:, j]
        if bias is not None:
            y = y + bias
        return F.silu(y) if self.activation else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return x + y if self.residual else y
