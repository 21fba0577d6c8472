"""A model family: the one object the registry, conversion and HF registration ask for what builds,
parallelizes and converts its models (its ``[model]`` args, in ``args.py``, carry its rules:
validation, parallelism limits, kernel backends)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.protocols.model_spec import ModelSpec

from canon_titan.hf import HFModel


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """``[model] name``: the family's one spelling."""
    parallelize: Callable
    """TorchTitan's ``parallelize_fn``."""
    state_dict_adapter: type
    """Its ``CanonStateDictAdapter``: Hugging Face names, layouts and config.json."""
    hf_models: tuple[HFModel, ...]
    """Our transformers classes its exports may use."""

    def spec(self, flavor: str, args) -> ModelSpec:
        """The ModelSpec of resolved ``args`` (``args.model_config()`` builds the model's
        config)."""
        return ModelSpec(
            name=self.name,
            flavor=flavor,
            model=args.model_config(),
            parallelize_fn=self.parallelize,
            pipelining_fn=pipeline_llm,
            post_optimizer_build_fn=None,
            state_dict_adapter=self.state_dict_adapter,
        )
