"""canon-titan: pretraining Canon-augmented language models on TorchTitan."""


def _register_with_transformers() -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM`` know LlamaCanon once canon_titan is imported."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:  # conversion and evaluation need transformers; training does not
        return
    from canon_titan.hf.configuration_llama_canon import LlamaCanonConfig
    from canon_titan.hf.modeling_llama_canon import LlamaCanonForCausalLM

    AutoConfig.register(LlamaCanonConfig.model_type, LlamaCanonConfig, exist_ok=True)
    AutoModelForCausalLM.register(LlamaCanonConfig, LlamaCanonForCausalLM, exist_ok=True)


_register_with_transformers()
