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

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
from torchtitan.protocols.module import Module

from canon_titan.kernels.canon import canon_conv, canon_swiglu
from canon_titan.models.common.context_parallel import ContextShards
from canon_titan.models.common.init import canon_bias_init, canon_weight_init
from canon_titan.models.common.norms import RMSNorm
from canon_titan.models.common.tensor_parallel import ChannelShard, local, tp_sum_together


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
        self.residual, self.activation, self.backend = (
            config.residual,
            config.activation,
            config.backend,
        )
        self.weight = nn.Parameter(torch.empty(config.channels, 1, config.kernel_size))
        self.bias = nn.Parameter(torch.empty(config.channels)) if config.bias else None
        # Set by tensor parallelism where the inputs are column-sharded (Canon-B/D, short
        # convolutions).
        self.channel_shard: ChannelShard | None = None

    def reset_parameters(self) -> None:
        """PyTorch's conv initialisation, for a config built without ``param_init``."""
        canon_weight_init(self.weight)
        if self.bias is not None:
            canon_bias_init(self.bias, self.kernel_size)

    def _weights(
        self, like: torch.Tensor, sizes: list[int], partials: list[torch.Tensor] = ()
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None]], list[torch.Tensor]]:
        """(weight [c, K], bias) for consecutive inputs of ``sizes`` channels (this rank's share of
        each under tensor parallelism), and ``partials`` summed over the TP group in one
        all-reduce."""
        weight = local(self.weight, like).squeeze(1)
        bias = local(self.bias, like)
        if self.channel_shard is not None:
            partials = tp_sum_together(partials, self.channel_shard.group)
            weights = self.channel_shard.rows(weight, sizes)
            biases = (
                self.channel_shard.rows(bias, sizes) if bias is not None else [None] * len(sizes)
            )
        else:
            weights = weight.split(sizes)
            biases = bias.split(sizes) if bias is not None else [None] * len(sizes)
        return list(zip(weights, biases)), partials

    def _convolve(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        norm: RMSNorm | None,
        shards: ContextShards | None,
        positions: torch.Tensor | None,
        square_sum: torch.Tensor | None = None,
    ) -> torch.Tensor:
        row_scale = col_scale = None
        if norm is not None:
            row_scale = norm.inverse_rms(x, square_sum).squeeze(-1)
            col_scale = local(norm.weight, x)
        halo, split = self._halo(shards, x, row_scale)
        return canon_conv(
            x,
            weight,
            bias,
            row_scale=row_scale,
            col_scale=col_scale,
            residual=self.residual,
            activation=self.activation,
            positions=positions,
            halo=halo,
            split=split,
            backend=self.backend,
        )

    def _halo(
        self, shards: ContextShards | None, x: torch.Tensor, row_scale: torch.Tensor | None = None
    ):
        """Under context parallelism, the rows before each of this rank's runs
        (``ContextShards.halo``)."""
        return (None, -1) if shards is None else shards.halo(x, self.kernel_size, row_scale)

    def forward(
        self,
        x: torch.Tensor,
        norm: RMSNorm | None = None,
        shards: ContextShards | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer on ``x`` [batch, seq, channels], or on ``norm(x)``; with ``positions``
        [batch, seq] (each token's position in its document) the taps stay inside each document."""
        ((weight, bias),), _ = self._weights(x, [x.shape[-1]])
        return self._convolve(x, weight, bias, norm, shards, positions)

    def segments(
        self,
        *xs: torch.Tensor,
        norms: tuple[RMSNorm | None, ...] | None = None,
        shards: ContextShards | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The layer on the concatenation of ``xs`` along channels (each through its norm, if any),
        without concatenating. Under tensor parallelism the statistics of flat norms (QK-norm) are
        summed over the group together, in one all-reduce."""
        norms = norms or (None,) * len(xs)
        flat = [
            i
            for i, norm in enumerate(norms)
            if self.channel_shard is not None and norm is not None and norm.tp_group is not None
        ]
        weights, sums = self._weights(
            xs[0], [x.shape[-1] for x in xs], [norms[i].square_sum(xs[i]) for i in flat]
        )
        square_sums = dict(zip(flat, sums))
        return tuple(
            self._convolve(x, w, b, norm, shards, positions, square_sums.get(i))
            for i, (x, (w, b), norm) in enumerate(zip(xs, weights, norms))
        )

    def swiglu(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        shards: ContextShards | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``silu(g) * u`` with ``g, u`` this layer on [gate | up] (Canon-D and the SwiGLU after
        it)."""
        if self.channel_shard is None:
            weight, bias = local(self.weight, gate).squeeze(1), local(self.bias, gate)
        else:  # this rank's gate rows and up rows, one [2h, K] weight for the fused op
            ((w_gate, b_gate), (w_up, b_up)), _ = self._weights(
                gate, [gate.shape[-1], up.shape[-1]]
            )
            weight = torch.cat((w_gate, w_up))
            bias = torch.cat((b_gate, b_up)) if b_gate is not None else None
        (halo_gate, split), (halo_up, _) = self._halo(shards, gate), self._halo(shards, up)
        return canon_swiglu(
            gate,
            up,
            weight,
            bias,
            residual=self.residual,
            activation=self.activation,
            positions=positions,
            halo=(halo_gate, halo_up) if shards is not None else None,
            split=split,
            backend=self.backend,
        )
