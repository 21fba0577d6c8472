"""GLA5: the release's gated linear attention (``GatedCanonLinearAttention``, spec 5.2).

    q, k, v = SiLU(b(W x)) with b (else SiLU(W x));  key width d, value width 2d, H heads
    log_gate = logsigmoid(gk_proj(x)) / 16             per key channel, gk_proj of rank 16
    S_t = diag(exp(log_gate_t)) S_{t-1} + k_t^T v_t,   o_t = q_t S_t / sqrt(head_k_dim)
    out = o_proj(RMSNorm_head(o) * w * SiLU(g_proj(x)))  g_proj of rank 16 (GLA5's change)

q, k, v, o projections hold 6 d^2 parameters. Initialisation (initializer_range 0.02): every
linear and short-convolution weight N(0, 0.02), biases zero; both factors of the low-rank
projections N(0, sqrt(0.02) / 16^(1/4)); norms one; embedding N(0, 0.02).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchtitan.models.common import Linear
from torchtitan.protocols.module import Module

from canon_titan.kernels import gla
from canon_titan.models.canon import CanonConv
from canon_titan.models.linear import (GatedRMSNorm, LinearArgs, LowRankLinear, low_rank, normal_init,
                                       split_init, upcast)
from canon_titan.models.llama import ONES_INIT

INIT_STD = 0.02
GATE_RANK = 16
"""Rank of the forget-gate (gate_low_rank_dim) and output-gate (output_gate_rank) projections."""
GATE_LOGIT_NORMALIZER = 16


class GLA5Mixer(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        n_heads: int
        head_k_dim: int
        head_v_dim: int
        q_proj: Linear.Config
        k_proj: Linear.Config
        v_proj: Linear.Config
        gk_proj: LowRankLinear.Config
        g_proj: LowRankLinear.Config
        o_proj: Linear.Config
        g_norm: GatedRMSNorm.Config
        q_conv1d: CanonConv.Config | None = None
        k_conv1d: CanonConv.Config | None = None
        v_conv1d: CanonConv.Config | None = None
        backend: str = "torch"
        """Resolved kernel backend: 'torch' or 'fla'."""

        family = "GLA5"
        tensor_parallel = True

        @property
        def recurrent_state_size(self) -> int:
            return self.n_heads * self.head_k_dim * self.head_v_dim

    def __init__(self, config: Config):
        super().__init__()
        self.head_k_dim, self.head_v_dim, self.backend = config.head_k_dim, config.head_v_dim, config.backend
        self.q_proj = config.q_proj.build()
        self.k_proj = config.k_proj.build()
        self.v_proj = config.v_proj.build()
        self.gk_proj = config.gk_proj.build()
        self.g_proj = config.g_proj.build()
        self.o_proj = config.o_proj.build()
        self.g_norm = config.g_norm.build()
        convs = (config.q_conv1d, config.k_conv1d, config.v_conv1d)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (c.build() if c is not None else None for c in convs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_conv1d is not None:
            q, k, v = self.q_conv1d(q), self.k_conv1d(k), self.v_conv1d(v)
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        log_gate = F.logsigmoid(upcast(self.gk_proj(x))) / GATE_LOGIT_NORMALIZER
        # Heads from the widths, not a count: under tensor parallelism a rank holds some of them.
        q, k, log_gate = (t.unflatten(-1, (-1, self.head_k_dim)) for t in (q, k, log_gate))
        v = v.unflatten(-1, (-1, self.head_v_dim))
        o, _ = gla(q, k, v, log_gate, backend=self.backend)
        gate = self.g_proj(x).unflatten(-1, (-1, self.head_v_dim))
        return self.o_proj(self.g_norm(o, gate).flatten(-2))


@dataclass(kw_only=True)
class GLA5Args(LinearArgs):
    family = "GLA5"
    kernel_op = "gla"

    def validate(self) -> list[tuple[str, str]]:
        problems = LinearArgs.validate(self)
        if self.n_heads > 0 and self.dim % self.n_heads:
            problems.append(("n_heads", f"must divide dim ({self.dim})"))
        return problems

    def linear_init(self) -> dict:
        return normal_init(INIT_STD)

    def embedding_std(self) -> float:
        return INIT_STD

    def mixer_config(self, kernel_backend: str) -> GLA5Mixer.Config:
        d, init = self.dim, normal_init(INIT_STD)
        key_dim, value_dim = d, 2 * d
        gate_init = split_init(INIT_STD, GATE_RANK)
        return GLA5Mixer.Config(
            n_heads=self.n_heads,
            head_k_dim=key_dim // self.n_heads,
            head_v_dim=value_dim // self.n_heads,
            q_proj=Linear.Config(in_features=d, out_features=key_dim, param_init=init),
            k_proj=Linear.Config(in_features=d, out_features=key_dim, param_init=init),
            v_proj=Linear.Config(in_features=d, out_features=value_dim, param_init=init),
            gk_proj=low_rank(d, GATE_RANK, key_dim, gate_init),
            g_proj=low_rank(d, GATE_RANK, value_dim, gate_init),
            o_proj=Linear.Config(in_features=value_dim, out_features=d, param_init=init),
            g_norm=GatedRMSNorm.Config(dim=value_dim // self.n_heads, eps=self.norm_eps, norm_before_gate=True,
                                       param_init=ONES_INIT),
            q_conv1d=self.short_conv(key_dim, bias=False, param_init=init),
            k_conv1d=self.short_conv(key_dim, bias=False, param_init=init),
            v_conv1d=self.short_conv(value_dim, bias=False, param_init=init),
            backend=kernel_backend,
        )
