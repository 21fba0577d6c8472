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
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.models.common import Linear
from torchtitan.protocols.module import Module

from canon_titan.kernels import ssd
from canon_titan.models.canon import CanonConv, canon_bias_init, canon_weight_init
from canon_titan.models.gdn2 import dt_bias_init, log_uniform_init
from canon_titan.models.linear import SHORT_CONV_SIZE, GatedRMSNorm, LinearArgs, torch_default_init, upcast
from canon_titan.models.llama import ONES_INIT

EXPAND = 2
"""d_inner = EXPAND * dim."""
EMBEDDING_STD = 0.1
"""The release's initializer_range for Mamba2, used only by the embedding."""


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

        family = "Mamba2"
        # The gated norm and the single B/C group span every head.
        tensor_parallel = False

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, heads = self.state_size, self.dt_bias.shape[0]
        z, xbc, dt = self.in_proj(x).split([self.d_inner, self.d_inner + 2 * n, heads], dim=-1)
        if self.conv1d is not None:
            xbc = self.conv1d(xbc)
        xs, B, C = xbc.split([self.d_inner, n, n], dim=-1)
        dt = F.softplus(upcast(dt) + upcast(self.dt_bias))
        A = -upcast(self.A_log).exp()
        y, _ = ssd(xs.unflatten(-1, (heads, self.head_dim)), dt, A, B.unsqueeze(2), C.unsqueeze(2), D=self.D,
                   chunk_size=self.chunk_size, backend=self.backend)
        return self.out_proj(self.norm(y.flatten(-2), z))


@dataclass(kw_only=True)
class Mamba2Args(LinearArgs):
    state_size: int = 128
    """N, the state per head channel (the recipes' ``mamba_ssm: 128``)."""
    chunk_size: int = 256
    """Block length of the chunked scan (the release's 256); changes speed and rounding only."""

    family = "Mamba2"
    kernel_op = "ssd"

    @property
    def head_dim(self) -> int:
        return EXPAND * self.dim // self.n_heads

    def validate(self) -> list[tuple[str, str]]:
        problems = LinearArgs.validate(self)
        if self.n_heads > 0 and EXPAND * self.dim % self.n_heads:
            problems.append(("n_heads", f"must divide the inner width {EXPAND} * dim ({EXPAND * self.dim})"))
        for name in ("state_size", "chunk_size"):
            if getattr(self, name) <= 0:
                problems.append((name, "must be > 0"))
        return problems

    def linear_init(self) -> dict:
        return torch_default_init()

    def embedding_std(self) -> float:
        return EMBEDDING_STD

    def mixer_config(self, kernel_backend: str) -> Mamba2Mixer.Config:
        d, heads, n = self.dim, self.n_heads, self.state_size
        d_inner = EXPAND * d
        init = torch_default_init()
        return Mamba2Mixer.Config(
            n_heads=heads,
            head_dim=d_inner // heads,
            state_size=n,
            chunk_size=self.chunk_size,
            in_proj=Linear.Config(in_features=d, out_features=2 * d_inner + 2 * n + heads, param_init=init),
            conv1d=self.short_conv(d_inner + 2 * n, bias=True, param_init={
                "weight": canon_weight_init, "bias": partial(canon_bias_init, kernel_size=SHORT_CONV_SIZE)}),
            norm=GatedRMSNorm.Config(dim=d_inner, eps=self.norm_eps, norm_before_gate=False, param_init=ONES_INIT),
            out_proj=Linear.Config(in_features=d_inner, out_features=d, param_init=init),
            backend=kernel_backend,
            param_init={"A_log": partial(log_uniform_init, low=1.0, high=16.0), "D": nn.init.ones_,
                        "dt_bias": dt_bias_init},
        )
