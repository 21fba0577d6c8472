"""canon-titan: pretraining Canon-augmented language models on TorchTitan."""

import importlib.util
import logging


def _quiet_known_noise() -> None:
    """Drop two messages that every import of TorchTitan prints and that tell a user nothing:
    torchao trying to load its CUDA-only kernel libraries (``Failed to load ..._C_mxfp8...so``) on
    a machine without them, and torch's notice that torchao still registers enums with pytree
    (torchao's code, not ours). Everything else from both loggers still shows."""
    logging.getLogger("torchao").addFilter(lambda record: not record.getMessage().startswith("Failed to load"))
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda record: "is an Enum subclass and is now natively supported" not in record.getMessage())


def _register_with_transformers() -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM`` know our model types once canon_titan is imported."""
    if importlib.util.find_spec("transformers") is None:  # conversion and evaluation need it; training does not
        return
    from canon_titan.hf import register_with_transformers

    register_with_transformers()


_quiet_known_noise()
_register_with_transformers()
