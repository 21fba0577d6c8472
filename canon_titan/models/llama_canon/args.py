"""The ``[model]`` keys of a LlamaCanon: a Llama's, plus the Canon layers'."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.tools.logging import logger

from canon_titan.models.common.canon_args import CanonArgs
from canon_titan.models.llama.args import LlamaArgs, model


@dataclass(kw_only=True)
class LlamaCanonArgs(CanonArgs, LlamaArgs):
    """``canon_set`` is any subset of "ABCD"; "" builds no Canon module, exactly a ``llama``."""

    label = "LlamaCanon"

    def validate(self) -> list[tuple[str, str]]:
        return LlamaArgs.validate(self) + self.canon_problems()

    def model_config(self) -> model.LlamaModel.Config:
        if self.canon_set:
            logger.info(f"Canon layers: {self.describe_canon()}")
        return LlamaArgs.model_config(self)
