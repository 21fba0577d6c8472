"""The Llama block and model of the PhysicsLM4 release, as a TorchTitan ``Decoder``.

Pre-norm blocks with float32 RMSNorm, SwiGLU, untied embeddings, GQA, interleaved (partial) RoPE,
optional QK-norm over the flat q/k projections (one statistic across all heads), causal SDPA over
the packed sequence, and the Lingua initialisation (truncated normal, std ``fan_in ** -0.5``).

Canon layers (LlamaCanon) sit at four places in a block:
  A: after the attention norm;  B: on concat(q, k, v) after QK-norm, before RoPE;
  C: after the FFN norm;        D: on concat(gate, up) before the SiLU.
A block without Canon layers is exactly the ``llama`` family's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.models.common import Linear
from torchtitan.models.common.decoder import Decoder, TransformerBlock
from torchtitan.models.utils import get_dense_model_nparams_and_flops
from torchtitan.protocols.module import Module

from canon_titan.models.common.canon import CanonConv
from canon_titan.models.common.context_parallel import ContextShards
from canon_titan.models.common.decoder import CanonDecoder, normed
from canon_titan.models.common.norms import RMSNorm
from canon_titan.models.common.rope import PartialRoPE


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] mask: causal, and only within a document (positions restart at 0)."""
    document = torch.cumsum(positions == 0, dim=1)
    same = document[:, :, None] == document[:, None, :]
    causal = torch.ones(
        positions.shape[1], positions.shape[1], dtype=torch.bool, device=positions.device
    ).tril()
    return (same & causal)[:, None]


class Attention(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        n_heads: int
        n_kv_heads: int
        head_dim: int
        wq: Linear.Config
        wk: Linear.Config
        wv: Linear.Config
        wo: Linear.Config
        rope: PartialRoPE.Config
        q_norm: RMSNorm.Config | None = None
        k_norm: RMSNorm.Config | None = None
        canonB: CanonConv.Config | None = None

    def __init__(self, config: Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.enable_gqa = config.n_heads != config.n_kv_heads
        self.wq = config.wq.build()
        self.wk = config.wk.build()
        self.wv = config.wv.build()
        self.wo = config.wo.build()
        self.q_norm = config.q_norm.build() if config.q_norm is not None else None
        self.k_norm = config.k_norm.build() if config.k_norm is not None else None
        self.rope = config.rope.build()
        self.canonB = config.canonB.build() if config.canonB is not None else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        shards: ContextShards | None = None,
        canon_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # QK-norm: over the whole flat projection, before splitting into heads (fused into Canon-B).
        if self.canonB is not None:
            q, k, v = self.canonB.segments(
                q,
                k,
                v,
                norms=(self.q_norm, self.k_norm, None),
                shards=shards,
                positions=canon_positions,
            )
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq_len, -1, self.head_dim)
        k = k.view(batch, seq_len, -1, self.head_dim)
        v = v.view(batch, seq_len, -1, self.head_dim)
        q, k = self.rope(q, k, positions)
        if (
            shards is not None
        ):  # context parallel: against the keys and values of the whole sequence
            return self.wo(shards.attention(q, k, v, self.enable_gqa).flatten(2))
        mask = None if positions is None else document_causal_mask(positions)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=self.enable_gqa,
        )
        return self.wo(out.transpose(1, 2).flatten(2))


class LlamaBlock(TransformerBlock):
    """TorchTitan's pre-norm block (``attention``, ``feed_forward``, ``attention_norm``,
    ``ffn_norm``) with Canon-A and Canon-C after the two norms."""

    @dataclass(kw_only=True, slots=True)
    class Config(TransformerBlock.Config):
        canonA: CanonConv.Config | None = None
        canonC: CanonConv.Config | None = None
        canon_document_reset: bool = False
        """The Canon layers' taps stay inside each document when the batch has document positions
        (``[model] canon_document_reset``); otherwise they reach across, as the release's."""

    def __init__(self, config: Config):
        super().__init__()
        self.attention_norm = config.attention_norm.build()
        self.attention = config.attention.build()
        self.ffn_norm = config.ffn_norm.build()
        self.feed_forward = config.feed_forward.build()
        self.canonA = config.canonA.build() if config.canonA is not None else None
        self.canonC = config.canonC.build() if config.canonC is not None else None
        self.canon_document_reset = config.canon_document_reset

    def forward(self, x: torch.Tensor, attention_masks=None, positions: torch.Tensor | None = None):
        # Under context parallelism the trainer passes the sequence split as ``attention_masks``.
        shards = attention_masks if isinstance(attention_masks, ContextShards) else None
        canon = positions if self.canon_document_reset else None
        h = x + self.attention(
            normed(x, self.attention_norm, self.canonA, shards, canon),
            positions,
            shards=shards,
            canon_positions=canon,
        )
        return h + self.feed_forward(
            normed(h, self.ffn_norm, self.canonC, shards, canon), shards=shards, positions=canon
        )


class LlamaModel(CanonDecoder):
    @dataclass(kw_only=True, slots=True)
    class Config(CanonDecoder.Config):
        def update_from_config(self, *, config, **kwargs) -> None:
            # The release's RoPE has no length limit: the table grows to the training length
            # (TorchTitan's check refuses a seq_len beyond the configured table).
            seq_len = getattr(getattr(config, "training", None), "seq_len", None)
            if seq_len is not None:
                for layer in self.layers:
                    rope = layer.attention.rope
                    layer.attention.rope = dataclasses.replace(
                        rope, max_seq_len=max(rope.max_seq_len, seq_len)
                    )
            Decoder.Config.update_from_config(self, config=config, **kwargs)

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            attention = self.layers[0].attention
            return get_dense_model_nparams_and_flops(
                model,
                n_layers=len(self.layers),
                n_heads=attention.n_heads,
                head_dims=2 * attention.head_dim,
                seq_len=seq_len,
                enable_weight_tying=self.enable_weight_tying,
            )
