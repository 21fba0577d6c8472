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
from functools import partial
from typing import ClassVar, Literal

import torch
import torch.nn as nn

from torchtitan.protocols.module import Module

from canon_titan.kernels.backends import resolve_backend
from canon_titan.kernels.canon import canon_conv, canon_swiglu
from canon_titan.models.common.context_parallel import ContextShards
from canon_titan.models.common.norms import RMSNorm
from canon_titan.models.common.tensor_parallel import ChannelShard, local

CANON_POSITIONS = "ABCD"
CANON_KERNEL_SIZES = (2, 3, 4)


def canon_weight_init(weight: torch.Tensor) -> None:
    """``nn.Conv1d``'s default: kaiming-uniform with a=sqrt(5), i.e. U(-1/sqrt(K), 1/sqrt(K))."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def canon_bias_init(bias: torch.Tensor, kernel_size: int) -> None:
    bound = 1 / math.sqrt(kernel_size)
    nn.init.uniform_(bias, -bound, bound)


def conv_init(kernel_size: int) -> dict:
    """PyTorch's default ``nn.Conv1d`` initialisation of weight and bias."""
    return {"weight": canon_weight_init, "bias": partial(canon_bias_init, kernel_size=kernel_size)}


def conv_backend(requested: str) -> str:
    """The backend of Canon layers for ``[model] canon_backend`` ('auto' decided for this machine;
    whether a forced one runs here is for ``CanonArgs.canon_problems``)."""
    return resolve_backend(requested, op="canon", check=False)[0]


@dataclass(kw_only=True)
class CanonArgs:
    """The ``[model]`` keys of the Canon layers, shared by LlamaCanon and the linear models."""

    canon_set: str = "ABCD"
    """Canon positions to enable."""
    canon_kernel: int = 4
    canon_residual: bool = True
    canon_activation: bool = False
    canon_bias: bool = False
    canon_backend: str = "auto"
    """'auto' (the Triton kernels on a CUDA GPU, else torch), 'torch' or 'triton'."""

    canon_letters: ClassVar[str] = CANON_POSITIONS
    """The letters ``canon_set`` may use."""
    canon_set_note: ClassVar[str] = ""
    """Said after the letters when ``canon_set`` is wrong."""

    def enabled(self) -> set[str]:
        """The positions ``canon_set`` enables."""
        return set(self.canon_set)

    def canon_problems(self) -> list[tuple[str, str]]:
        """(key, message) pairs for the Canon keys."""
        problems = []
        letters = "".join(sorted(self.enabled()))
        if any(c not in self.canon_letters for c in letters) or len(letters) != len(self.canon_set.replace("bb", "b")):
            problems.append(("canon_set", f"must be distinct letters from {self.canon_letters!r}{self.canon_set_note}, "
                                          f"got {self.canon_set!r}"))
        if self.canon_kernel not in CANON_KERNEL_SIZES:
            problems.append(("canon_kernel", f"must be 2, 3 or 4, got {self.canon_kernel}"))
        if self.canon_backend == "causal_conv1d":
            problems.append(("canon_backend", "'causal_conv1d' was removed: its [batch, channel, seq] kernel needed "
                                              "transposes and graph breaks; 'triton' (or 'auto' on a GPU) is the fused "
                                              "kernel that replaces it"))
        else:
            try:
                resolve_backend(self.canon_backend, op="canon")
            except ValueError as e:
                problems.append(("canon_backend", str(e)))
        return problems

    def canon(self, position: str, channels: int) -> CanonConv.Config | None:
        """The Canon layer at ``position``, or None where ``canon_set`` has none."""
        if position not in self.enabled():
            return None
        return CanonConv.Config(
            channels=channels, kernel_size=self.canon_kernel, residual=self.canon_residual,
            activation=self.canon_activation, bias=self.canon_bias, backend=conv_backend(self.canon_backend),
            param_init=conv_init(self.canon_kernel),
        )

    def describe_canon(self) -> str:
        return (f"canon_set {self.canon_set!r} (kernel {self.canon_kernel}, residual {self.canon_residual}, "
                f"activation {self.canon_activation}, bias {self.canon_bias}), conv backend "
                f"{conv_backend(self.canon_backend)} (requested {self.canon_backend})")


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
        """PyTorch's conv initialisation, for a config built without ``param_init``."""
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

    def _halos(self, shards: ContextShards | None, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Under context parallelism, each input's runs with the rows before them (see ``ContextShards``)."""
        return xs if shards is None else tuple(shards.with_halos(x, self.kernel_size) for x in xs)

    def _unhalo(self, shards: ContextShards | None, y: torch.Tensor) -> torch.Tensor:
        return y if shards is None else shards.without_halos(y, self.kernel_size)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, shards: ContextShards | None = None) -> torch.Tensor:
        """The layer on ``x`` [batch, seq, channels], or on ``norm(x)``."""
        ((weight, bias),) = self._weights(x, [x.shape[-1]])
        (x,) = self._halos(shards, x)
        return self._unhalo(shards, self._convolve(x, weight, bias, norm))

    def segments(self, *xs: torch.Tensor, norms: tuple[RMSNorm | None, ...] | None = None,
                 shards: ContextShards | None = None) -> tuple[torch.Tensor, ...]:
        """The layer on the concatenation of ``xs`` along channels (each through its norm, if any),
        without concatenating."""
        weights = self._weights(xs[0], [x.shape[-1] for x in xs])
        norms = norms or (None,) * len(xs)
        return tuple(self._unhalo(shards, self._convolve(x, w, b, norm))
                     for x, (w, b), norm in zip(self._halos(shards, *xs), weights, norms))

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, shards: ContextShards | None = None) -> torch.Tensor:
        """``silu(g) * u`` with ``g, u`` this layer on [gate | up] (Canon-D and the SwiGLU after it)."""
        if self.channel_shard is None:
            weight, bias = local(self.weight, gate).squeeze(1), local(self.bias, gate)
        else:  # this rank's gate rows and up rows, one [2h, K] weight for the fused op
            (w_gate, b_gate), (w_up, b_up) = self._weights(gate, [gate.shape[-1], up.shape[-1]])
            weight = torch.cat((w_gate, w_up))
            bias = torch.cat((b_gate, b_up)) if b_gate is not None else None
        gate, up = self._halos(shards, gate, up)
        return self._unhalo(shards, canon_swiglu(gate, up, weight, bias, residual=self.residual,
                                                 activation=self.activation, backend=self.backend))
