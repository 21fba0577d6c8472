"""GDN2: the release's gated DeltaNet (``GatedDeltaNetCanon``, spec 5.3).

    q, k, v = SiLU(b(W x)) with b (else SiLU(W x));  head_dim d/H (GDN2's change), value width 2d
    q, k L2-normalised per head (fla's use_qk_l2norm_in_kernel, eps 1e-6)
    beta = sigmoid(b_proj(x));  log_decay = -exp(A_log) * softplus(a_proj(x) + dt_bias)   per head
    S_t = (I - beta_t k_t k_t^T) exp(log_decay_t) S_{t-1} + beta_t k_t v_t^T,  o_t = q_t S_t / sqrt(head_dim)
    out = o_proj(RMSNorm_head(o) * w * SiLU(g_proj(x)))   g_proj of rank 16

Initialisation as GLA5 (N(0, 0.02) linears and short convolutions, split init of the low-rank
factors), plus A = U(0, 16), A_log = log A, and dt_bias the inverse softplus of a log-uniform
dt in [0.001, 0.1] floored at 1e-4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.models.common import Linear
from torchtitan.protocols.module import Module

from canon_titan.kernels import gated_delta_rule
from canon_titan.models.canon import CanonConv
from canon_titan.models.gla5 import GATE_RANK, INIT_STD
from canon_titan.models.linear import (GatedRMSNorm, LinearArgs, LowRankLinear, low_rank, normal_init,
                                       split_init, upcast)
from canon_titan.models.llama import ONES_INIT
from canon_titan.models.tensor_parallel import local

L2NORM_EPS = 1e-6


@torch.no_grad()
def log_uniform_init(param: torch.Tensor, low: float, high: float) -> None:
    """log U(low, high), in place (works on sharded DTensors too)."""
    nn.init.uniform_(param, low, high).log_()


@torch.no_grad()
def dt_bias_init(param: torch.Tensor, dt_min: float = 0.001, dt_max: float = 0.1, floor: float = 1e-4) -> None:
    """softplus^-1(dt) for dt log-uniform in [dt_min, dt_max], floored (Mamba2's time-step init)."""
    nn.init.uniform_(param, math.log(dt_min), math.log(dt_max)).exp_().clamp_(min=floor)
    param.copy_(param + torch.log(-torch.expm1(-param)))


def l2norm(x: torch.Tensor) -> torch.Tensor:
    xf = upcast(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)).type_as(x)


class GDN2Mixer(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        n_heads: int
        head_dim: int
        head_v_dim: int
        q_proj: Linear.Config
        k_proj: Linear.Config
        v_proj: Linear.Config
        b_proj: Linear.Config
        a_proj: Linear.Config
        g_proj: LowRankLinear.Config
        o_proj: Linear.Config
        o_norm: GatedRMSNorm.Config
        q_conv1d: CanonConv.Config | None = None
        k_conv1d: CanonConv.Config | None = None
        v_conv1d: CanonConv.Config | None = None
        backend: str = "torch"
        """Resolved kernel backend: 'torch' or 'fla'."""

        family = "GDN2"
        tensor_parallel = True

        @property
        def recurrent_state_size(self) -> int:
            return self.n_heads * self.head_dim * self.head_v_dim

    def __init__(self, config: Config):
        super().__init__()
        self.head_dim, self.head_v_dim, self.backend = config.head_dim, config.head_v_dim, config.backend
        self.q_proj = config.q_proj.build()
        self.k_proj = config.k_proj.build()
        self.v_proj = config.v_proj.build()
        self.b_proj = config.b_proj.build()
        self.a_proj = config.a_proj.build()
        self.A_log = nn.Parameter(torch.empty(config.n_heads))
        self.dt_bias = nn.Parameter(torch.empty(config.n_heads))
        self.g_proj = config.g_proj.build()
        self.o_proj = config.o_proj.build()
        self.o_norm = config.o_norm.build()
        convs = (config.q_conv1d, config.k_conv1d, config.v_conv1d)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (c.build() if c is not None else None for c in convs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_conv1d is not None:
            q, k, v = self.q_conv1d(q), self.k_conv1d(k), self.v_conv1d(v)
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        # Heads from the widths, not a count: under tensor parallelism a rank holds some of them.
        q, k = (l2norm(t.unflatten(-1, (-1, self.head_dim))) for t in (q, k))
        v = v.unflatten(-1, (-1, self.head_v_dim))
        beta = self.b_proj(x).sigmoid()
        A_log, dt_bias = local(self.A_log, x), local(self.dt_bias, x)
        log_decay = -upcast(A_log).exp() * F.softplus(upcast(self.a_proj(x)) + upcast(dt_bias))
        o, _ = gated_delta_rule(q, k, v, log_decay, beta, backend=self.backend)
        gate = self.g_proj(x).unflatten(-1, (-1, self.head_v_dim))
        return self.o_proj(self.o_norm(o, gate).flatten(-2))


@dataclass(kw_only=True)
class GDN2Args(LinearArgs):
    family = "GDN2"
    kernel_op = "gated_delta_rule"

    def validate(self) -> list[tuple[str, str]]:
        problems = LinearArgs.validate(self)
        if self.n_heads > 0 and self.dim % self.n_heads:
            problems.append(("n_heads", f"must divide dim ({self.dim})"))
        return problems

    def linear_init(self) -> dict:
        return normal_init(INIT_STD)

    def embedding_std(self) -> float:
        return INIT_STD

    def mixer_config(self, kernel_backend: str) -> GDN2Mixer.Config:
        d, heads, init = self.dim, self.n_heads, normal_init(INIT_STD)
        key_dim, value_dim = d, 2 * d
        return GDN2Mixer.Config(
            n_heads=heads,
            head_dim=key_dim // heads,
            head_v_dim=value_dim // heads,
            q_proj=Linear.Config(in_features=d, out_features=key_dim, param_init=init),
            k_proj=Linear.Config(in_features=d, out_features=key_dim, param_init=init),
            v_proj=Linear.Config(in_features=d, out_features=value_dim, param_init=init),
            b_proj=Linear.Config(in_features=d, out_features=heads, param_init=init),
            a_proj=Linear.Config(in_features=d, out_features=heads, param_init=init),
            g_proj=low_rank(d, GATE_RANK, value_dim, split_init(INIT_STD, GATE_RANK)),
            o_proj=Linear.Config(in_features=value_dim, out_features=d, param_init=init),
            o_norm=GatedRMSNorm.Config(dim=value_dim // heads, eps=self.norm_eps, norm_before_gate=True,
                                       param_init=ONES_INIT),
            q_conv1d=self.short_conv(key_dim, bias=False, param_init=init),
            k_conv1d=self.short_conv(key_dim, bias=False, param_init=init),
            v_conv1d=self.short_conv(value_dim, bias=False, param_init=init),
            backend=kernel_backend,
            param_init={"A_log": partial(log_uniform_init, low=0.0, high=16.0), "dt_bias": dt_bias_init},
        )
