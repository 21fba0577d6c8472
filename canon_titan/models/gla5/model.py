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

from canon_titan.kernels import gla
from canon_titan.kernels.documents import Documents
from canon_titan.models.common.linear import FlaMixer, GatedRMSNorm, LowRankLinear, upcast

GATE_LOGIT_NORMALIZER = 16


class GLA5Mixer(FlaMixer):
    @dataclass(kw_only=True, slots=True)
    class Config(FlaMixer.Config):
        n_heads: int
        head_k_dim: int
        head_v_dim: int
        gk_proj: LowRankLinear.Config
        g_norm: GatedRMSNorm.Config

        @property
        def recurrent_state_size(self) -> int:
            return self.n_heads * self.head_k_dim * self.head_v_dim

    def __init__(self, config: Config):
        super().__init__(config)
        self.head_k_dim, self.head_v_dim = config.head_k_dim, config.head_v_dim

    def build_projections(self, config: Config) -> None:
        self.gk_proj = config.gk_proj.build()

    def build_norm(self, config: Config) -> None:
        self.g_norm = config.g_norm.build()

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x, documents)
        log_gate = F.logsigmoid(upcast(self.gk_proj(x))) / GATE_LOGIT_NORMALIZER
        # Heads from the widths, not a count: under tensor parallelism a rank holds some of them.
        q, k, log_gate = (t.unflatten(-1, (-1, self.head_k_dim)) for t in (q, k, log_gate))
        v = v.unflatten(-1, (-1, self.head_v_dim))
        o, _ = gla(q, k, v, log_gate, documents=documents, backend=self.backend)
        gate = self.g_proj(x).unflatten(-1, (-1, self.head_v_dim))
        return self.o_proj(self.g_norm(o, gate).flatten(-2))
