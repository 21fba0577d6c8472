"""A model family: the one object the registry, conversion, config checks and HF registration ask
(its ``[model]`` args carry its rules: validation, parallelism limits, kernel backends)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from canon_titan.hf import HFModel


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """``[model] name``: the family's one spelling."""
    args: type
    """The dataclass of its ``[model]`` keys; ``model_config()`` builds the model's config."""
    parallelize: Callable
    """TorchTitan's ``parallelize_fn``."""
    state_dict_adapter: type
    """Its ``CanonStateDictAdapter``: Hugging Face names, layouts and config.json."""
    hf_models: tuple[HFModel, ...]
    """Our transformers classes its exports may use."""
