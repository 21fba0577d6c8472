"""Canon layer: a causal depthwise convolution along the sequence, with a residual connection.

``out[t, c] = x[t, c] + sum_j w[c, 0, j] * x[t - (K-1) + j, c]`` (+ bias, optional SiLU before the
residual), with zeros before the first token: weight index ``K-1`` multiplies the current token.
The weight is ``[C, 1, K]`` like ``nn.Conv1d(C, C, K, groups=C)`` and keeps PyTorch's default
conv initialisation (uniform in +-1/sqrt(K), std ~0.289 for K=4); re-initialising it to a small
std hurts (PhysicsLM4).

One module serves every position. Its input may be one tensor (Canon-A/C, the linear models'
short convolutions), several that share the weight's channels in order (Canon-B on q, k, v:
``segments``), or Canon-D's [gate | up], fused with the SwiGLU product after it (``swiglu``).
The RMSNorm before Canon-A/C (and QK-norm before Canon-B) is passed in and fused: the op scales its
input by the norm's inverse RMS and weight, so it saves the norm's input (which the norm's own
backward needs anyway) instead of a second, normalised copy. The op and its backends (``torch``,
``triton``) are in ``canon_titan.kernels.canon``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from torchtitan.protocols.module import Module

from canon_titan.kernels.canon import canon_conv, canon_swiglu, resolve_backend
from canon_titan.models.norms import RMSNorm
from canon_titan.models.tensor_parallel import ChannelShard, local

CANON_POSITIONS = "ABCD"

__all__ = ["CANON_POSITIONS", "CanonConv", "backend_problems", "canon_bias_init", "canon_weight_init",
           "resolve_backend"]


def backend_problems(backend: str, kernel_size: int) -> list[tuple[str, str]]:
    """``[model] canon_backend`` problems, as (key, message) pairs."""
    if backend == "causal_conv1d":
        return [("canon_backend", "'causal_conv1d' was removed: its [batch, channel, seq] kernel needed transposes "
                                  "and graph breaks; 'triton' (or 'auto' on a GPU) is the fused kernel that replaces it")]
    try:
        resolve_backend(backend, kernel_size)
    except ValueError as e:
        return [("canon_backend", str(e))]
    return []


def canon_weight_init(weight: torch.Tensor) -> None:
    """``nn.Conv1d``'s default: kaiming-uniform with a=sqrt(5), i.e. U(-1/sqrt(K), 1/sqrt(K))."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def canon_bias_init(bias: torch.Tensor, kernel_size: int) -> None:
    bound = 1 / math.sqrt(kernel_size)
    nn.init.uniform_(bias, -bound, bound)


class CanonConv(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        channels: int
        kernel_size: int = 4
        residual: bool = True
        activation: bool = False
        """SiLU after the convolution (before the residual)."""
        bias: bool = False
        backend: Literal["torch", "triton"] = "torch"

    def __init__(self, config: Config):
        super().__init__()
        self.kernel_size = config.kernel_size
        self.residual, self.activation, self.backend = config.residual, config.activation, config.backend
        self.weight = nn.Parameter(torch.empty(config.channels, 1, config.kernel_size))
        self.bias = nn.Parameter(torch.empty(config.channels)) if config.bias else None
        # Set by tensor parallelism where the inputs are column-sharded (Canon-B/D, short convolutions).
        self.channel_shard: ChannelShard | None = None

    def reset_parameters(self) -> None:
        canon_weight_init(self.weight)
        if self.bias is not None:
            canon_bias_init(self.bias, self.kernel_size)

    def _weights(self, like: torch.Tensor, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight [c, K], bias) for consecutive inputs of ``sizes`` channels (this rank's share of
        each under tensor parallelism)."""
        weight, bias = local(self.weight, like).squeeze(1), local(self.bias, like)
        if self.channel_shard is not None:
            weights = self.channel_shard.rows(weight, sizes)
            biases = self.channel_shard.rows(bias, sizes) if bias is not None else [None] * len(sizes)
        else:
            weights = weight.split(sizes)
            biases = bias.split(sizes) if bias is not None else [None] * len(sizes)
        return list(zip(weights, biases))

    def _convolve(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  norm: RMSNorm | None) -> torch.Tensor:
        row_scale = col_scale = None
        if norm is not None:
            row_scale, col_scale = norm.inverse_rms(x).squeeze(-1), local(norm.weight, x)
        return canon_conv(x, weight, bias, row_scale=row_scale, col_scale=col_scale, residual=self.residual,
                          activation=self.activation, backend=self.backend)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """The layer on ``x`` [batch, seq, channels], or on ``norm(x)``."""
        ((weight, bias),) = self._weights(x, [x.shape[-1]])
        return self._convolve(x, weight, bias, norm)

    def segments(self, *xs: torch.Tensor, norms: tuple[RMSNorm | None, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """The layer on the concatenation of ``xs`` along channels (each through its norm, if any),
        without concatenating."""
        weights = self._weights(xs[0], [x.shape[-1] for x in xs])
        norms = norms or (None,) * len(xs)
        return tuple(self._convolve(x, w, b, norm) for x, (w, b), norm in zip(xs, weights, norms))

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(g) * u`` with ``g, u`` this layer on [gate | up] (Canon-D and the SwiGLU after it)."""
        if self.channel_shard is None:
            weight, bias = local(self.weight, gate).squeeze(1), local(self.bias, gate)
        else:  # this rank's gate rows and up rows, one [2h, K] weight for the fused op
            (w_gate, b_gate), (w_up, b_up) = self._weights(gate, [gate.shape[-1], up.shape[-1]])
            weight = torch.cat((w_gate, w_up))
            bias = torch.cat((b_gate, b_up)) if b_gate is not None else None
        return canon_swiglu(gate, up, weight, bias, residual=self.residual, activation=self.activation,
                            backend=self.backend)
