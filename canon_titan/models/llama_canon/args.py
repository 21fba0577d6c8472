"""The ``[model]`` keys of a LlamaCanon: a Llama's, plus the Canon layers'."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan.tools.logging import logger

from canon_titan.models.common.canon_args import CanonArgs
from canon_titan.models.llama.args import LlamaArgs, model


@dataclass(kw_only=True)
class LlamaCanonArgs(CanonArgs, LlamaArgs):
    """``canon_set`` is any subset of "ABCD"; "" builds no Canon module, exactly a ``llama``."""

    canon_document_reset: bool = False
    """Where the batch has document positions (``[dataloader] document_masking``, the synthetic
    tasks), start the Canon layers at each document: their taps that would reach into the previous
    document add nothing. False: the taps reach across documents while attention stays inside them
    (the release never masked documents)."""

    label = "LlamaCanon"

    def validate(self) -> list[tuple[str, str]]:
        return LlamaArgs.validate(self) + self.canon_problems()

    def block_config(self) -> model.LlamaBlock.Config:
        return dataclasses.replace(
            LlamaArgs.block_config(self), canon_document_reset=self.canon_document_reset
        )

    def model_config(self) -> model.LlamaModel.Config:
        if self.canon_set:
            documents = (
                "start at each document"
                if self.canon_document_reset
                else "reach across document boundaries, as the release's "
                "(canon_document_reset false)"
            )
            logger.info(
                f"Canon layers: {self.describe_canon()}; with document positions their "
                f"taps {documents}"
            )
        return LlamaArgs.model_config(self)
