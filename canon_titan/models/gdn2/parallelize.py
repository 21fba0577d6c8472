"""GDN2 under tensor parallelism: q/k/v, the per-head b_proj/a_proj and the output gate's
up-projection by head, A_log and dt_bias with their heads."""

from __future__ import annotations

from functools import partial

from canon_titan.models.common import linear_parallelize
from canon_titan.models.common.linear_parallelize import MixerLayout
from canon_titan.models.common.parallelize import parallelize_decoder

LAYOUT = MixerLayout(
    colwise=("q_proj", "k_proj", "v_proj", "b_proj", "a_proj", "g_proj.up"),
    replicated=("g_proj.down",),
    per_head=("A_log", "dt_bias"),
    gated_norm="o_norm",
)


def parallelize_gdn2(model, **kwargs):
    return parallelize_decoder(
        model,
        parallelize_block=partial(linear_parallelize.parallelize_block, layout=LAYOUT),
        **kwargs,
    )
