"""GDN2: the release's gated DeltaNet (``GatedDeltaNetCanon``, spec 5.3).

    q, k, v = SiLU(b(W x)) with b (else SiLU(W x));  head_dim d/H (GDN2's change), value width 2d
    q, k L2-normalised per head (fla's use_qk_l2norm_in_kernel, eps 1e-6)
    beta = sigmoid(b_proj(x));  log_decay = -exp(A_log) * softplus(a_proj(x) + dt_bias)   per head
    S_t = (I - beta_t k_t k_t^T) exp(log_decay_t) S_{t-1} + beta_t k_t v_t^T,  o_t = q_t S_t /
        sqrt(head_dim)
    out = o_proj(RMSNorm_head(o) * w * SiLU(g_proj(x)))   g_proj of rank 16

Initialisation as GLA5 (N(0, 0.02) linears and short convolutions, split init of the low-rank
factors), plus A = U(0, 16), A_log = log A, and dt_bias the inverse softplus of a log-uniform
dt in [0.001, 0.1] floored at 1e-4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.models.common import Linear

from canon_titan.kernels import gated_delta_rule
from canon_titan.kernels.documents import Documents
from canon_titan.models.common.linear import FlaMixer, GatedRMSNorm, upcast
from canon_titan.models.common.tensor_parallel import local

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    xf = upcast(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)).type_as(x)


class GDN2Mixer(FlaMixer):
    @dataclass(kw_only=True, slots=True)
    class Config(FlaMixer.Config):
        n_heads: int
        head_dim: int
        head_v_dim: int
        b_proj: Linear.Config
        a_proj: Linear.Config
        o_norm: GatedRMSNorm.Config

        @property
        def recurrent_state_size(self) -> int:
            return self.n_heads * self.head_dim * self.head_v_dim

    def __init__(self, config: Config):
        super().__init__(config)
        self.head_dim, self.head_v_dim = config.head_dim, config.head_v_dim
        self.A_log = nn.Parameter(torch.empty(config.n_heads))
        self.dt_bias = nn.Parameter(torch.empty(config.n_heads))

    def build_projections(self, config: Config) -> None:
        self.b_proj = config.b_proj.build()
        self.a_proj = config.a_proj.build()

    def build_norm(self, config: Config) -> None:
        self.o_norm = config.o_norm.build()

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x, documents)
        # Heads from the widths, not a count: under tensor parallelism a rank holds some of them.
        q, k = (l2norm(t.unflatten(-1, (-1, self.head_dim))) for t in (q, k))
        v = v.unflatten(-1, (-1, self.head_v_dim))
        beta = self.b_proj(x).sigmoid()
        A_log, dt_bias = local(self.A_log, x), local(self.dt_bias, x)
        log_decay = -upcast(A_log).exp() * F.softplus(upcast(self.a_proj(x)) + upcast(dt_bias))
        o, _ = gated_delta_rule(q, k, v, log_decay, beta, documents=documents, backend=self.backend)
        gate = self.g_proj(x).unflatten(-1, (-1, self.head_v_dim))
        return self.o_proj(self.o_norm(o, gate).flatten(-2))
