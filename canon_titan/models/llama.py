"""Llama of the PhysicsLM4 release, as a TorchTitan ``Decoder``.

Pre-norm blocks with float32 RMSNorm, SwiGLU, untied embeddings, GQA, interleaved (partial) RoPE,
optional QK-norm over the flat q/k projections (one statistic across all heads), causal SDPA over
the packed sequence, and the Lingua initialisation (truncated normal, std ``fan_in ** -0.5``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.utils import get_dense_model_nparams_and_flops
from torchtitan.protocols.module import Module

from canon_titan.models.norms import RMSNorm
from canon_titan.models.rope import PartialRoPE


def truncated_normal_init(std: float) -> dict:
    """Lingua's init: normal(0, std) truncated at +-3 std."""
    return {"weight": partial(nn.init.trunc_normal_, std=std, a=-3 * std, b=3 * std)}


ONES_INIT = {"weight": nn.init.ones_}


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.q_norm is not None:
            # Normalised over the whole flat projection, before splitting into heads.
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq_len, -1, self.head_dim)
        k = k.view(batch, seq_len, -1, self.head_dim)
        v = v.view(batch, seq_len, -1, self.head_dim)
        q, k = self.rope(q, k, positions)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, enable_gqa=self.enable_gqa,
        )
        return self.wo(out.transpose(1, 2).flatten(2))


class FeedForward(Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        w1: Linear.Config
        w2: Linear.Config
        w3: Linear.Config

    def __init__(self, config: Config):
        super().__init__()
        self.w1 = config.w1.build()
        self.w2 = config.w2.build()
        self.w3 = config.w3.build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        attention: Attention.Config
        feed_forward: FeedForward.Config
        attention_norm: RMSNorm.Config
        ffn_norm: RMSNorm.Config

    def __init__(self, config: Config):
        super().__init__()
        self.attention_norm = config.attention_norm.build()
        self.attention = config.attention.build()
        self.ffn_norm = config.ffn_norm.build()
        self.feed_forward = config.feed_forward.build()

    def forward(self, x: torch.Tensor, attention_masks=None, positions: torch.Tensor | None = None):
        h = x + self.attention(self.attention_norm(x), positions)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaModel(Decoder):
    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        def update_from_config(self, *, config, **kwargs) -> None:
            parallelism = config.parallelism
            if self.enable_weight_tying and parallelism.pipeline_parallel_degree > 1:
                raise ValueError("weight tying is not supported with pipeline parallelism")
            attention = self.layers[0].attention
            tp = parallelism.tensor_parallel_degree
            for name, heads in (("n_heads", attention.n_heads), ("n_kv_heads", attention.n_kv_heads)):
                if heads % tp:
                    raise ValueError(
                        f"parallelism.tensor_parallel_degree ({tp}) must divide model.{name} ({heads})"
                    )
            seq_len = getattr(getattr(config, "training", None), "seq_len", None)
            if seq_len is not None:
                for layer in self.layers:
                    layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)

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


def ffn_hidden_dim(dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """Lingua's rule: 8/3 of dim, optionally scaled, rounded up to a multiple of ``multiple_of``."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(kw_only=True)
class LlamaArgs:
    """The flat, user-facing shape of a Llama model: one TOML ``[model]`` key per field."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    ffn_hidden_dim: int | None = None
    """SwiGLU hidden size; None applies the 8/3 rule rounded to ``multiple_of``."""
    multiple_of: int = 256
    vocab_size: int
    rope_theta: float = 10000.0
    rope_dim: int | None = None
    """Channels per head that RoPE rotates; None means the whole head."""
    qk_norm: bool = False
    z_loss: bool = False
    """Add the reference's squared-NLL term ``1e-4 * l**2`` to the per-token loss."""
    norm_eps: float = 1e-5
    max_seq_len: int = 4096
    """RoPE table length; training overwrites it with ``training.seq_len``."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim or ffn_hidden_dim(self.dim, self.multiple_of)

    def validate(self) -> list[tuple[str, str]]:
        """Problems as (field, message) pairs; empty when the shape is buildable."""
        problems = []
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                problems.append((name, "must be > 0"))
        if self.n_heads > 0 and self.dim % self.n_heads:
            problems.append(("n_heads", f"must divide dim ({self.dim})"))
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            problems.append(("n_kv_heads", f"must be > 0 and divide n_heads ({self.n_heads})"))
        if self.rope_dim is not None and self.n_heads > 0 and self.dim % self.n_heads == 0:
            if self.rope_dim <= 0 or self.rope_dim % 2 or self.rope_dim > self.head_dim:
                problems.append(
                    ("rope_dim", f"must be an even number in [2, head_dim={self.head_dim}]")
                )
        if self.norm_eps <= 0:
            problems.append(("norm_eps", "must be > 0"))
        return problems

    def block_config(self) -> LlamaBlock.Config:
        dim, hd, hidden = self.dim, self.head_dim, self.hidden_dim
        n_q, n_kv = self.n_heads * hd, self.kv_heads * hd
        linear_init = truncated_normal_init(dim**-0.5)
        norm = partial(RMSNorm.Config, eps=self.norm_eps, param_init=ONES_INIT)
        return LlamaBlock.Config(
            attention_norm=norm(dim=dim),
            ffn_norm=norm(dim=dim),
            attention=Attention.Config(
                dim=dim,
                n_heads=self.n_heads,
                n_kv_heads=self.kv_heads,
                head_dim=hd,
                wq=Linear.Config(in_features=dim, out_features=n_q, param_init=linear_init),
                wk=Linear.Config(in_features=dim, out_features=n_kv, param_init=linear_init),
                wv=Linear.Config(in_features=dim, out_features=n_kv, param_init=linear_init),
                wo=Linear.Config(in_features=n_q, out_features=dim, param_init=linear_init),
                rope=PartialRoPE.Config(
                    rope_dim=self.rope_dim or hd, theta=self.rope_theta, max_seq_len=self.max_seq_len
                ),
                q_norm=norm(dim=n_q) if self.qk_norm else None,
                k_norm=norm(dim=n_kv) if self.qk_norm else None,
            ),
            feed_forward=FeedForward.Config(
                w1=Linear.Config(in_features=dim, out_features=hidden, param_init=linear_init),
                w3=Linear.Config(in_features=dim, out_features=hidden, param_init=linear_init),
                w2=Linear.Config(
                    in_features=hidden, out_features=dim, param_init=truncated_normal_init(hidden**-0.5)
                ),
            ),
        )

    def model_config(self) -> LlamaModel.Config:
        dim = self.dim
        return LlamaModel.Config(
            dim=dim,
            vocab_size=self.vocab_size,
            tok_embeddings=Embedding.Config(
                num_embeddings=self.vocab_size, embedding_dim=dim, param_init=truncated_normal_init(dim**-0.5)
            ),
            norm=RMSNorm.Config(dim=dim, eps=self.norm_eps, param_init=ONES_INIT),
            lm_head=Linear.Config(
                in_features=dim, out_features=self.vocab_size, param_init=truncated_normal_init(dim**-0.5)
            ),
            layers=[self.block_config() for _ in range(self.n_layers)],
        )
