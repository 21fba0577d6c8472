"""Float8 training through torchao, via TorchTitan's model-config converter.

Only ``Linear`` layers are converted: Canon convolutions, norms and embeddings stay in high
precision (and ``[float8] filter_fqns``, default ``["lm_head"]``, keeps chosen linears out).
"""

from __future__ import annotations

import dataclasses

from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.tools.logging import logger

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


class Float8Converter(Float8LinearConverter):
    """TorchTitan's converter plus the tensorwise recipe, and an emulated mode that keeps the
    recipe's scaling (TorchTitan's emulation always falls back to tensorwise)."""

    def __init__(self, config: Float8LinearConverter.Config):
        super().__init__(config)
        from torchao.float8 import Float8LinearConfig

        torchao_config = Float8LinearConfig.from_recipe_name(config.recipe_name)
        if config.emulate:
            torchao_config = dataclasses.replace(torchao_config, emulate=True)
        self.torchao_config = torchao_config
        logger.info(f"float8: recipe {config.recipe_name}, {'emulated' if config.emulate else 'hardware'} matmuls")


def float8_converter(section: dict, model_compiled: bool) -> Float8Converter:
    return Float8Converter(Float8LinearConverter.Config(
        recipe_name=section["recipe_name"],
        emulate=section["emulate"],
        filter_fqns=list(section["filter_fqns"]),
        model_compile_enabled=model_compiled,
    ))
