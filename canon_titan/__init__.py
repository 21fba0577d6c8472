"""canon-titan: pretraining Canon-augmented language models on TorchTitan."""

import importlib.util


def _register_with_transformers() -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM`` know our model types once canon_titan is imported."""
    if importlib.util.find_spec("transformers") is None:  # conversion and evaluation need it; training does not
        return
    from canon_titan.hf import register_with_transformers

    register_with_transformers()


_register_with_transformers()
