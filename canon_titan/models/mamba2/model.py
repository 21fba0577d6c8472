"""Mamba2: the release's Mamba2 mixer (``Mamba2CanonMixer``, spec 5.4) with one group of B/C.

    [z | xBC | dt] = in_proj(x)                     widths d_inner = 2d, d_inner + 2N, H
    xBC = SiLU(conv1d(xBC)) with b (a biased depthwise conv, kernel 4), else xBC unchanged
    [x | B | C] = xBC;  x in H heads of head_dim = 2d / H (256 in the release)
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,  y_t = h_t C_t + D x_t
        with dt = softplus(dt + dt_bias), A = -exp(A_log)
    out = out_proj(RMSNorm(y * SiLU(z)) * w)        gated norm over the whole d_inner

Initialisation: linears PyTorch's default (U(+-1/sqrt(fan_in)), biases zero), conv1d PyTorch's
default, embedding N(0, 0.1), A_log = log U(1, 16), D = 1, dt_bias as in GDN2, norms one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.models.common import Linear
from torchtitan.protocols.module import Module

from canon_titan.kernels import ssd
from canon_titan.kernels.documents import Documents
from canon_titan.models.common.canon import CanonConv
from canon_titan.models.common.linear import GatedRMSNorm, upcast


class Mamba2Mixer(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        n_heads: int
        head_dim: int
        state_size: int
        chunk_size: int
        in_proj: Linear.Config
        norm: GatedRMSNorm.Config
        out_proj: Linear.Config
        conv1d: CanonConv.Config | None = None
        backend: str = "torch"
        """Resolved kernel backend: 'torch' or 'mamba_ssm'."""

        @property
        def recurrent_state_size(self) -> int:
            return self.n_heads * self.head_dim * self.state_size

    def __init__(self, config: Config):
        super().__init__()
        self.head_dim, self.state_size = config.head_dim, config.state_size
        self.chunk_size, self.backend = config.chunk_size, config.backend
        self.d_inner = config.n_heads * config.head_dim
        self.in_proj = config.in_proj.build()
        self.conv1d = config.conv1d.build() if config.conv1d is not None else None
        self.dt_bias = nn.Parameter(torch.empty(config.n_heads))
        self.A_log = nn.Parameter(torch.empty(config.n_heads))
        self.D = nn.Parameter(torch.empty(config.n_heads))
        self.norm = config.norm.build()
        self.out_proj = config.out_proj.build()

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        n, heads = self.state_size, self.dt_bias.shape[0]
        z, xbc, dt = self.in_proj(x).split([self.d_inner, self.d_inner + 2 * n, heads], dim=-1)
        if self.conv1d is not None:
            xbc = self.conv1d(xbc, positions=None if documents is None else documents.positions)
        xs, B, C = xbc.split([self.d_inner, n, n], dim=-1)
        dt = F.softplus(upcast(dt) + upcast(self.dt_bias))
        A = -upcast(self.A_log).exp()
        y, _ = ssd(
            xs.unflatten(-1, (heads, self.head_dim)),
            dt,
            A,
            B.unsqueeze(2),
            C.unsqueeze(2),
            D=self.D,
            chunk_size=self.chunk_size,
            documents=documents,
            backend=self.backend,
        )
        return self.out_proj(self.norm(y.flatten(-2), z))
