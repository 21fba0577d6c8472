"""Hugging Face transformers classes for LlamaCanon and the linear models (GLACanon,
GatedDeltaNetCanon, Mamba2Canon).

The modules here import only torch and transformers (and each other, relatively): ``canon-titan
convert to-hf`` copies a model's modules next to exported weights, so the export loads with
``trust_remote_code=True`` on machines without canon-titan. Each model family names its classes
(its state-dict adapter's ``hf_model``); ``model_registry.register_with_transformers`` makes
transformers' Auto classes know them (then ``trust_remote_code`` is not needed). Importing this
package does not import transformers.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from importlib import import_module

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtypes an export is written in and an export is loaded in (``export_dtype``, ``[eval]
dtype``)."""


class HFFormatError(ValueError):
    """A Hugging Face folder or config that does not describe the run's model."""


@dataclass(frozen=True)
class HFModel:
    """The transformers classes of one model family, as ``module.Class`` paths inside this
    package."""

    config: str
    model: str
    shared: tuple[str, ...] = ()
    """Further modules the two import."""

    @property
    def architecture(self) -> str:
        return self.model.split(".")[1]

    @property
    def auto_map(self) -> dict[str, str]:
        return {"AutoConfig": self.config, "AutoModelForCausalLM": self.model}

    @property
    def files(self) -> tuple[str, ...]:
        """The files to ship next to the weights."""
        return tuple(
            f"{m}.py" for m in (self.config.split(".")[0], self.model.split(".")[0], *self.shared)
        )

    def classes(self) -> tuple[type, type]:
        """(config class, causal-LM class)."""
        found = []
        for path in (self.config, self.model):
            module, name = path.split(".")
            found.append(getattr(import_module(f"{__name__}.{module}"), name))
        return found[0], found[1]


def register(models: Iterable[HFModel]) -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM`` know these model types."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for hf_model in models:
        config_cls, model_cls = hf_model.classes()
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
