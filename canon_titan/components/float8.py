"""Float8 training through torchao, via TorchTitan's model-config converter.

Only ``Linear`` layers are converted: Canon convolutions, norms and embeddings stay in high
precision (and ``[float8] filter_fqns``, default ``["lm_head"]``, keeps chosen linears out).

``[float8] enable_fsdp_float8_all_gather`` (tensorwise only) has FSDP gather those linears'
weights in float8: torchao's ``WeightWithDynamicFloat8CastTensor`` wraps each weight before
tensor parallelism and FSDP see it (``models/common/parallelize.py``), so each rank casts its FSDP
shard before the all-gather, and the gathered weight is the float8 tensor the linear would have
cast, with the scale of the whole weight. Where that scale comes from: with
``precompute_float8_dynamic_scale_for_fsdp``, one all-reduce of every weight's amax over all of
its shards after the checkpoint load that starts training and after each optimizer step
(``precompute_float8_scales``); without it, torchao's pre-all-gather hook all-reduces each
weight's amax over the FSDP mesh, which is the whole weight only without TP (under TP it is the
rank's TP shard: the config checks require the precomputed scales there). TorchTitan 0.3.0 dropped
the option; its earlier releases had it, and its published float8 runs of June 2025 used it.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.tools.logging import logger

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


class Float8Converter(Float8LinearConverter):
    """TorchTitan's converter plus the tensorwise recipe, an emulated mode that keeps the recipe's
    scaling (TorchTitan's emulation always falls back to tensorwise), and FSDP's float8
    all-gather."""

    def __init__(self, config: Float8LinearConverter.Config, fsdp_float8_all_gather: bool = False):
        super().__init__(config)
        from torchao.float8 import Float8LinearConfig

        torchao_config = Float8LinearConfig.from_recipe_name(config.recipe_name)
        if config.emulate:
            torchao_config = dataclasses.replace(torchao_config, emulate=True)
        if fsdp_float8_all_gather:
            torchao_config = dataclasses.replace(torchao_config, enable_fsdp_float8_all_gather=True)
        self.torchao_config = torchao_config
        logger.info(
            f"float8: recipe {config.recipe_name}, "
            f"{'emulated' if config.emulate else 'hardware'} matmuls"
            + (", FSDP all-gathers the weights in float8" if fsdp_float8_all_gather else "")
        )


def float8_converter(section: dict, model_compiled: bool) -> Float8Converter:
    return Float8Converter(
        Float8LinearConverter.Config(
            recipe_name=section["recipe_name"],
            emulate=section["emulate"],
            filter_fqns=list(section["filter_fqns"]),
            model_compile_enabled=model_compiled,
        ),
        fsdp_float8_all_gather=section["enable_fsdp_float8_all_gather"],
    )


def precompute_float8_scales(model_parts: list[nn.Module]) -> None:
    """Every FSDP-sharded float8 weight's scale for its next all-gather, from the amax of the whole
    weight (all of its FSDP and TP shards), in one all-reduce per part (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``); run after the weights change: a checkpoint load,
    each optimizer step."""
    from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

    for part in model_parts:
        precompute_float8_dynamic_scale_for_fsdp(part)
