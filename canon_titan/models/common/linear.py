"""What the linear models of PhysicsLM4 Part 4.2 (GLA5, GDN2, Mamba2; spec section 5) share: the
LM, the block, the gated RMSNorm and the low-rank projection (their ``[model]`` args are in
``linear_args.py``).

Block (pre-norm, as the release's GLABlock / GatedDeltaNetCanonBlock / Mamba2CanonBlock):
    h = x + mixer(CanonA(mixer_norm(x)));    out = h + feed_forward(CanonC(ffn_norm(h)))
where the feed-forward is the SwiGLU with Canon-D on [gate | up] (the release's fused
``gate_proj``/``both_proj`` split into ``w1``/``w3`` so tensor parallelism shards gate and up alike)
and hidden size 2 * dim unless given.

``canon_set`` letters:
  A, C, D  Canon layers at the Llama positions (residual, no activation, PyTorch default init).
  b        the family's built-in short convolution ("Canon-b"): GLA5/GDN2 one each on q, k and v,
           Mamba2 one on x|B|C. Not residual, SiLU, kernel 4. The release writes it "bb"
           ("AbbCD", "bb") only so that file names differ from "ABCD" on case-insensitive file
           systems; "b" and "bb" mean the same.
Without ``b``, GLA5/GDN2 apply SiLU straight to the q/k/v projections and Mamba2 passes x|B|C on
unchanged (the release's frozen identity kernel), as the reference does.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.models.common import Linear
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.utils import get_dense_model_nparams_and_flops
from torchtitan.protocols.module import Module

from canon_titan.kernels.documents import Documents
from canon_titan.models.common.canon import CanonConv
from canon_titan.models.common.decoder import CanonDecoder, FeedForward, normed
from canon_titan.models.common.norms import RMSNorm
from canon_titan.models.common.tensor_parallel import local


def upcast(t: torch.Tensor) -> torch.Tensor:
    """float32 for half precision; float64 stays float64 (tests compare in double)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class LowRankLinear(Module):
    """``up(down(x))``: a rank-r projection (the release's two-layer ``nn.Sequential``; ``up`` has a
    bias)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        down: Linear.Config
        up: Linear.Config

    def __init__(self, config: Config):
        super().__init__()
        self.down = config.down.build()
        self.up = config.up.build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


def low_rank(in_features: int, rank: int, out_features: int, init: dict) -> LowRankLinear.Config:
    return LowRankLinear.Config(
        down=Linear.Config(in_features=in_features, out_features=rank, param_init=init),
        up=Linear.Config(in_features=rank, out_features=out_features, bias=True, param_init=init),
    )


class GatedRMSNorm(Module):
    """RMSNorm with a SiLU gate over the last dim, in float32 (float64 stays float64).

    ``norm_before_gate``: ``norm(x) * w * silu(g)`` (fla's FusedRMSNormSwishGate, per head,
    GLA5/GDN2); otherwise ``norm(x * silu(g)) * w`` (Mamba2's gated norm over the whole inner
    width). Under tensor parallelism each rank applies the shared weight to its own heads, so its
    gradient is a partial sum (the plan marks it with ``partial_gradients``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        eps: float = 1e-5
        norm_before_gate: bool

    def __init__(self, config: Config):
        super().__init__()
        self.eps, self.norm_before_gate = config.eps, config.norm_before_gate
        self.weight = nn.Parameter(torch.empty(config.dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        weight = local(self.weight, x)
        xf, gate = upcast(x), F.silu(upcast(gate))
        if not self.norm_before_gate:
            xf = xf * gate
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * upcast(weight)
        if self.norm_before_gate:
            xf = xf * gate
        return xf.type_as(x)


class LinearBlock(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        mixer_norm: RMSNorm.Config
        mixer: Module.Config
        ffn_norm: RMSNorm.Config
        feed_forward: FeedForward.Config
        canonA: CanonConv.Config | None = None
        canonC: CanonConv.Config | None = None

    def __init__(self, config: Config):
        super().__init__()
        self.mixer_norm = config.mixer_norm.build()
        self.mixer = config.mixer.build()
        self.ffn_norm = config.ffn_norm.build()
        self.feed_forward = config.feed_forward.build()
        self.canonA = config.canonA.build() if config.canonA is not None else None
        self.canonC = config.canonC.build() if config.canonC is not None else None

    def forward(
        self,
        x: torch.Tensor,
        attention_masks: Documents | None = None,
        positions: torch.Tensor | None = None,
    ):
        # The attention blocks' signature; ``LinearLM`` passes the batch's documents as the masks.
        # With them, the recurrence, the short convolutions and the Canon layers keep the documents
        # apart.
        documents = attention_masks
        canon_positions = None if documents is None else documents.positions
        h = x + self.mixer(
            normed(x, self.mixer_norm, self.canonA, positions=canon_positions), documents
        )
        return h + self.feed_forward(
            normed(h, self.ffn_norm, self.canonC, positions=canon_positions),
            positions=canon_positions,
        )


class LinearLM(CanonDecoder):
    @dataclass(kw_only=True, slots=True)
    class Config(CanonDecoder.Config):
        @property
        def first_attention(self):
            # No attention layer: the trainer then builds no attention masks.
            return None

        @property
        def max_seq_len(self) -> int:
            # No positional encoding: any training length.
            return 2**62

        def update_from_config(self, *, config, **kwargs) -> None:
            problem = self.args.tensor_parallel_problem(config.parallelism.tensor_parallel_degree)
            if problem:
                raise ValueError(f"parallelism.tensor_parallel_degree: {problem}")
            Decoder.Config.update_from_config(self, config=config, **kwargs)

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            """TorchTitan's 6 FLOPs per parameter and token (no attention), plus for the recurrence
            a state update and a read-out per token (2 multiply-adds per state entry, times 3 for
            forward and backward)."""
            nparams, flops = get_dense_model_nparams_and_flops(
                model, n_layers=len(self.layers), n_heads=0, head_dims=0, seq_len=seq_len
            )
            return nparams, flops + 12 * sum(
                layer.mixer.recurrent_state_size for layer in self.layers
            )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks=None,
        cu_seqlens: torch.Tensor | None = None,
        chunk_indices: torch.Tensor | None = None,
    ):
        """With ``positions`` (the data loaders' ``document_masking``, the synthetic tasks' samples)
        every packed document is computed as if alone (``kernels/documents.py``); without, as the
        release trains: the state and the convolutions run across documents."""
        documents = None if positions is None else Documents(positions, cu_seqlens, chunk_indices)
        return Decoder.forward(self, tokens, positions, documents)


class FlaMixer(Module):
    """What GLA5's and GDN2's mixers share: q/k/v projections with their short convolutions, the
    low-rank output gate and the output projection. Modules are built in the release's order (it
    decides which random numbers each initialisation takes): q, k, v, the family's own projections,
    g, o, the family's gated norm, then the convolutions."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        q_proj: Linear.Config
        k_proj: Linear.Config
        v_proj: Linear.Config
        g_proj: LowRankLinear.Config
        o_proj: Linear.Config
        q_conv1d: CanonConv.Config | None = None
        k_conv1d: CanonConv.Config | None = None
        v_conv1d: CanonConv.Config | None = None
        backend: str = "torch"
        """Resolved kernel backend: 'torch' or 'fla'."""

    def __init__(self, config: Config):
        super().__init__()
        self.backend = config.backend
        self.q_proj = config.q_proj.build()
        self.k_proj = config.k_proj.build()
        self.v_proj = config.v_proj.build()
        self.build_projections(config)
        self.g_proj = config.g_proj.build()
        self.o_proj = config.o_proj.build()
        self.build_norm(config)
        convs = (config.q_conv1d, config.k_conv1d, config.v_conv1d)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            c.build() if c is not None else None for c in convs
        )

    @abstractmethod
    def build_projections(self, config: Config) -> None: ...

    @abstractmethod
    def build_norm(self, config: Config) -> None: ...

    def qkv(
        self, x: torch.Tensor, documents: Documents | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v = SiLU(b(W x)) with the short convolutions b (inside each document), else
        SiLU(W x)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_conv1d is not None:
            positions = None if documents is None else documents.positions
            return (
                self.q_conv1d(q, positions=positions),
                self.k_conv1d(k, positions=positions),
                self.v_conv1d(v, positions=positions),
            )
        return F.silu(q), F.silu(k), F.silu(v)
