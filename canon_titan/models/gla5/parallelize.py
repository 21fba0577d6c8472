"""GLA5 under tensor parallelism: q/k/v and the up-projections of both rank-16 gates by head."""

from __future__ import annotations

from functools import partial

from canon_titan.models.common import linear_parallelize
from canon_titan.models.common.linear_parallelize import MixerLayout
from canon_titan.models.common.parallelize import parallelize_decoder

LAYOUT = MixerLayout(
    colwise=("q_proj", "k_proj", "v_proj", "gk_proj.up", "g_proj.up"),
    replicated=("gk_proj.down", "g_proj.down"),
    per_head=(),
    gated_norm="g_norm",
)


def parallelize_gla5(model, **kwargs):
    return parallelize_decoder(
        model,
        parallelize_block=partial(linear_parallelize.parallelize_block, layout=LAYOUT),
        **kwargs,
    )
