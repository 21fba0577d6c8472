"""What every family's language model shares: the decoder config that remembers its ``[model]``
args, the embedding, the SwiGLU feed-forward with Canon-D, and the initialisations.

The models are TorchTitan ``Decoder``s. Deviations from TorchTitan's common modules, all the
release's: RMSNorm computed in float32 (``norms.RMSNorm``), interleaved partial RoPE
(``rope.PartialRoPE``), and an ``nn.Embedding`` that keeps a DTensor weight whole (below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.nn as nn
import tyro
from torchtitan.models.common import feed_forward
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module

from canon_titan.models.common.canon import CanonConv
from canon_titan.models.common.context_parallel import ContextShards
from canon_titan.models.common.init import ONES_INIT
from canon_titan.models.common.norms import RMSNorm


class CanonDecoder(Decoder):
    """A TorchTitan ``Decoder`` whose config keeps the family's ``[model]`` args it was built from:
    the family's state-dict adapter reads its Hugging Face names and config fields from them."""

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        args: Annotated[Any, tyro.conf.Suppress] = None

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks=None,
        cu_seqlens: torch.Tensor | None = None,
        chunk_indices: torch.Tensor | None = None,
    ):
        """TorchTitan's; with document masking the data loaders also send the documents' boundaries
        in fla's layout (``kernels/documents.py``), which only the linear models read."""
        return super().forward(tokens, positions, attention_masks)


class Embedding(nn.Embedding, Module):
    """``nn.Embedding`` as a torchtitan Module. TorchTitan's own Embedding unwraps a DTensor
    weight to its local shard, which breaks DTensor vocab-parallel (RowwiseParallel) lookup."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        num_embeddings: int
        embedding_dim: int

    def __init__(self, config: Config):
        super().__init__(config.num_embeddings, config.embedding_dim)


class FeedForward(feed_forward.FeedForward):
    """TorchTitan's SwiGLU ``w2(silu(w1 x) * w3 x)``, with Canon-D on [gate | up] when configured
    (fused with the SiLU product that follows it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(feed_forward.FeedForward.Config):
        canonD: CanonConv.Config | None = None

    def __init__(self, config: Config):
        super().__init__(config)
        self.canonD = config.canonD.build() if config.canonD is not None else None

    def forward(
        self,
        x: torch.Tensor,
        shards: ContextShards | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``positions``: Canon-D's taps stay inside each document (``CanonConv``)."""
        if self.canonD is None:
            return super().forward(x)
        gated = self.canonD.swiglu(self.w1(x), self.w3(x), shards=shards, positions=positions)
        return self.w2(gated)


def swiglu(
    dim: int, hidden: int, init: dict, out_init: dict, canonD: CanonConv.Config | None
) -> FeedForward.Config:
    return FeedForward.Config(
        w1=Linear.Config(in_features=dim, out_features=hidden, param_init=init),
        w3=Linear.Config(in_features=dim, out_features=hidden, param_init=init),
        w2=Linear.Config(in_features=hidden, out_features=dim, param_init=out_init),
        canonD=canonD,
    )


def normed(
    x: torch.Tensor,
    norm: RMSNorm,
    canon: CanonConv | None,
    shards: ContextShards | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``norm(x)``, or the Canon layer on it (which applies the norm itself, fused; its taps inside
    each document with ``positions``)."""
    return canon(x, norm, shards=shards, positions=positions) if canon is not None else norm(x)


def decoder_parts(
    dim: int, vocab_size: int, norm_eps: float, embedding_init: dict, lm_head_init: dict
) -> dict:
    """The embedding, final norm and output head of a ``Decoder.Config``."""
    return {
        "dim": dim,
        "vocab_size": vocab_size,
        "tok_embeddings": Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=embedding_init
        ),
        "norm": RMSNorm.Config(dim=dim, eps=norm_eps, param_init=ONES_INIT),
        "lm_head": Linear.Config(in_features=dim, out_features=vocab_size, param_init=lm_head_init),
    }
