"""Hugging Face transformers classes for LlamaCanon and the linear models (GLACanon,
GatedDeltaNetCanon, Mamba2Canon).

The modules here import only torch and transformers (and each other, relatively): ``canon-titan
convert to-hf`` copies a model's modules next to exported weights, so the export loads with
``trust_remote_code=True`` on machines without canon-titan. Importing this package registers the
classes with transformers' Auto classes (then ``trust_remote_code`` is not needed); the rest of
canon_titan imports transformers only where it converts or evaluates.
"""

from dataclasses import dataclass
from importlib import import_module


@dataclass(frozen=True)
class HFModel:
    """The transformers classes of one model family, as ``module.Class`` paths inside this package."""

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
        return tuple(f"{m}.py" for m in (self.config.split(".")[0], self.model.split(".")[0], *self.shared))

    def classes(self) -> tuple[type, type]:
        """(config class, causal-LM class)."""
        found = []
        for path in (self.config, self.model):
            module, name = path.split(".")
            found.append(getattr(import_module(f"{__name__}.{module}"), name))
        return found[0], found[1]


_LINEAR = ("linear_canon_layers",)
HF_MODELS = {
    "LlamaCanon": HFModel("configuration_llama_canon.LlamaCanonConfig", "modeling_llama_canon.LlamaCanonForCausalLM"),
    "GLA5": HFModel("configuration_gla_canon.GLACanonConfig", "modeling_gla_canon.GLACanonForCausalLM", _LINEAR),
    "GDN2": HFModel("configuration_gated_deltanet_canon.GatedDeltaNetCanonConfig",
                    "modeling_gated_deltanet_canon.GatedDeltaNetCanonForCausalLM", _LINEAR),
    "Mamba2": HFModel("configuration_mamba2_canon.Mamba2CanonConfig",
                      "modeling_mamba2_canon.Mamba2CanonForCausalLM", _LINEAR),
}
"""Keyed by model family (the linear models' ``family``; LlamaCanon for Llama with Canon layers)."""


def register_with_transformers() -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM`` know these model types."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for hf_model in HF_MODELS.values():
        config_cls, model_cls = hf_model.classes()
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)


register_with_transformers()
