"""The ``[model]`` keys of GDN2."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from torchtitan.models.common import Linear

from canon_titan.models.common.linear import INIT_STD, FlaLayerArgs, dt_bias_init, log_uniform_init, normal_init
from canon_titan.models.gdn2.model import GDN2Mixer


@dataclass(kw_only=True)
class GDN2Args(FlaLayerArgs):
    label = "GDN2"
    kernel_op = "gated_delta_rule"

    def mixer_config(self, kernel_backend: str) -> GDN2Mixer.Config:
        d, heads, init = self.dim, self.n_heads, normal_init(INIT_STD)
        return GDN2Mixer.Config(
            n_heads=heads,
            head_dim=d // heads,
            head_v_dim=2 * d // heads,
            b_proj=Linear.Config(in_features=d, out_features=heads, param_init=init),
            a_proj=Linear.Config(in_features=d, out_features=heads, param_init=init),
            o_norm=self.gated_norm(),
            backend=kernel_backend,
            param_init={"A_log": partial(log_uniform_init, low=0.0, high=16.0), "dt_bias": dt_bias_init},
            **self.attention_parts(),
        )
