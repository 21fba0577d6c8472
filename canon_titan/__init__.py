"""canon-titan: pretraining Canon-augmented language models on TorchTitan."""

import logging

from canon_titan.tools.startup import freeze_at_exit


def _quiet_known_noise() -> None:
    """Drop two messages that every import of TorchTitan prints and that tell a user nothing:
    torchao trying to load its CUDA-only kernel libraries (``Failed to load ..._C_mxfp8...so``) on
    a machine without them, and torch's notice that torchao still registers enums with pytree
    (torchao's code, not ours); and DTensor's note that a gradient norm over FSDP x TP (``_NormPartial``
    on two mesh dimensions) is reduced by two all-reduces of one scalar each, which costs nothing
    worth a line in the middle of a plan's table or a training log. Everything else from these
    loggers still shows."""
    logging.getLogger("torchao").addFilter(lambda record: not record.getMessage().startswith("Failed to load"))
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda record: "is an Enum subclass and is now natively supported" not in record.getMessage())
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
        lambda record: not record.getMessage().startswith("While redistributing from (_NormPartial"))


_quiet_known_noise()


freeze_at_exit()  # a process that imported TorchTitan spends seconds collecting it at exit
