"""The ``[model]`` keys of Mamba2."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch.nn as nn

from canon_titan.models.common.deferred import deferred
from canon_titan.models.common.init import (
    ONES_INIT,
    conv_init,
    dt_bias_init,
    log_uniform_init,
    torch_default_init,
)
from canon_titan.models.common.linear_args import SHORT_CONV_SIZE, LinearArgs, linear, titan

model = deferred("canon_titan.models.mamba2.model")

EXPAND = 2
"""d_inner = EXPAND * dim."""
EMBEDDING_STD = 0.1
"""The release's initializer_range for Mamba2, used only by the embedding."""


@dataclass(kw_only=True)
class Mamba2Args(LinearArgs):
    state_size: int = 128
    """N, the state per head channel (the recipes' ``mamba_ssm: 128``)."""
    chunk_size: int = 256
    """Block length of the chunked scan (the release's 256); changes speed and rounding only."""

    label = "Mamba2"
    kernel_op = "ssd"
    no_tensor_parallel = (
        "Mamba2 has no tensor-parallel plan (its in_proj interleaves z, x, B, C and dt, and its "
        "gated norm and single B/C group span every head); use FSDP/HSDP and PP, or tensor "
        "parallelism with gla5/gdn2"
    )

    @property
    def head_dim(self) -> int:
        return EXPAND * self.dim // self.n_heads

    def validate(self) -> list[tuple[str, str]]:
        problems = LinearArgs.validate(self)
        if self.n_heads > 0 and EXPAND * self.dim % self.n_heads:
            problems.append(
                ("n_heads", f"must divide the inner width {EXPAND} * dim ({EXPAND * self.dim})")
            )
        for name in ("state_size", "chunk_size"):
            if getattr(self, name) <= 0:
                problems.append((name, "must be > 0"))
        return problems

    def linear_init(self) -> dict:
        return torch_default_init()

    def embedding_std(self) -> float:
        return EMBEDDING_STD

    def mixer_config(self, kernel_backend: str) -> model.Mamba2Mixer.Config:
        d, heads, n = self.dim, self.n_heads, self.state_size
        d_inner = EXPAND * d
        init = torch_default_init()
        return model.Mamba2Mixer.Config(
            n_heads=heads,
            head_dim=d_inner // heads,
            state_size=n,
            chunk_size=self.chunk_size,
            in_proj=titan.Linear.Config(
                in_features=d, out_features=2 * d_inner + 2 * n + heads, param_init=init
            ),
            conv1d=self.short_conv(
                d_inner + 2 * n, bias=True, param_init=conv_init(SHORT_CONV_SIZE)
            ),
            norm=linear.GatedRMSNorm.Config(
                dim=d_inner, eps=self.norm_eps, norm_before_gate=False, param_init=ONES_INIT
            ),
            out_proj=titan.Linear.Config(in_features=d_inner, out_features=d, param_init=init),
            backend=kernel_backend,
            param_init={
                "A_log": partial(log_uniform_init, low=1.0, high=16.0),
                "D": nn.init.ones_,
                "dt_bias": dt_bias_init,
            },
        )
