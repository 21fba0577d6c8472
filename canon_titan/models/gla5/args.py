"""The ``[model]`` keys of GLA5."""

from __future__ import annotations

from dataclasses import dataclass

from canon_titan.models.common.deferred import deferred
from canon_titan.models.common.init import split_init
from canon_titan.models.common.linear_args import GATE_RANK, INIT_STD, FlaLayerArgs, linear

model = deferred("canon_titan.models.gla5.model")


@dataclass(kw_only=True)
class GLA5Args(FlaLayerArgs):
    label = "GLA5"
    kernel_op = "gla"

    def mixer_config(self, kernel_backend: str) -> model.GLA5Mixer.Config:
        return model.GLA5Mixer.Config(
            n_heads=self.n_heads,
            head_k_dim=self.dim // self.n_heads,
            head_v_dim=2 * self.dim // self.n_heads,
            gk_proj=linear.low_rank(self.dim, GATE_RANK, self.dim, split_init(INIT_STD, GATE_RANK)),
            g_norm=self.gated_norm(),
            backend=kernel_backend,
            **self.attention_parts(),
        )
