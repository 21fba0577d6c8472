"""The ``[model]`` keys of GDN2."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from canon_titan.models.common.deferred import deferred
from canon_titan.models.common.init import dt_bias_init, log_uniform_init, normal_init
from canon_titan.models.common.linear_args import INIT_STD, FlaLayerArgs, titan

model = deferred("canon_titan.models.gdn2.model")


@dataclass(kw_only=True)
class GDN2Args(FlaLayerArgs):
    label = "GDN2"
    kernel_op = "gated_delta_rule"

    def mixer_config(self, kernel_backend: str) -> model.GDN2Mixer.Config:
        d, heads, init = self.dim, self.n_heads, normal_init(INIT_STD)
        return model.GDN2Mixer.Config(
            n_heads=heads,
            head_dim=d // heads,
            head_v_dim=2 * d // heads,
            b_proj=titan.Linear.Config(in_features=d, out_features=heads, param_init=init),
            a_proj=titan.Linear.Config(in_features=d, out_features=heads, param_init=init),
            o_norm=self.gated_norm(),
            backend=kernel_backend,
            param_init={
                "A_log": partial(log_uniform_init, low=0.0, high=16.0),
                "dt_bias": dt_bias_init,
            },
            **self.attention_parts(),
        )
