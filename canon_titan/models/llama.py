"""Llama and LlamaCanon of the PhysicsLM4 release, as a TorchTitan ``Decoder``.

Pre-norm blocks with float32 RMSNorm, SwiGLU, untied embeddings, GQA, interleaved (partial) RoPE,
optional QK-norm over the flat q/k projections (one statistic across all heads), causal SDPA over
the packed sequence, and the Lingua initialisation (truncated normal, std ``fan_in ** -0.5``).

Canon layers (LlamaCanon) sit at four places in a block:
  A: after the attention norm;  B: on concat(q, k, v) after QK-norm, before RoPE;
  C: after the FFN norm;        D: on concat(gate, up) before the SiLU.
``canon_set = ""`` builds no Canon module at all: the model is then exactly ``llama``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.models.common import Linear
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.utils import get_dense_model_nparams_and_flops
from torchtitan.protocols.module import Module
from torchtitan.tools.logging import logger

from canon_titan.models.canon import (CANON_POSITIONS, CanonConv, backend_problems, canon_bias_init,
                                     canon_weight_init, resolve_backend)
from canon_titan.models.norms import RMSNorm
from canon_titan.models.rope import PartialRoPE


class Embedding(nn.Embedding, Module):
    """``nn.Embedding`` as a torchtitan Module. TorchTitan's own Embedding unwraps a DTensor
    weight to its local shard, which breaks DTensor vocab-parallel (RowwiseParallel) lookup."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        num_embeddings: int
        embedding_dim: int

    def __init__(self, config: Config):
        super().__init__(config.num_embeddings, config.embedding_dim)


def truncated_normal_init(std: float) -> dict:
    """Lingua's init: normal(0, std) truncated at +-3 std."""
    return {"weight": partial(nn.init.trunc_normal_, std=std, a=-3 * std, b=3 * std)}


ONES_INIT = {"weight": nn.init.ones_}


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] mask: causal, and only within a document (positions restart at 0)."""
    document = torch.cumsum(positions == 0, dim=1)
    same = document[:, :, None] == document[:, None, :]
    causal = torch.ones(positions.shape[1], positions.shape[1], dtype=torch.bool, device=positions.device).tril()
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # QK-norm: over the whole flat projection, before splitting into heads (fused into Canon-B).
        if self.canonB is not None:
            q, k, v = self.canonB.segments(q, k, v, norms=(self.q_norm, self.k_norm, None))
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq_len, -1, self.head_dim)
        k = k.view(batch, seq_len, -1, self.head_dim)
        v = v.view(batch, seq_len, -1, self.head_dim)
        q, k = self.rope(q, k, positions)
        mask = None if positions is None else document_causal_mask(positions)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, is_causal=mask is None, enable_gqa=self.enable_gqa,
        )
        return self.wo(out.transpose(1, 2).flatten(2))


class FeedForward(Module):
    """SwiGLU: ``w2(silu(gate) * up)`` with ``gate, up = w1 x, w3 x`` (Canon-D on [gate | up])."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        w1: Linear.Config
        w2: Linear.Config
        w3: Linear.Config
        canonD: CanonConv.Config | None = None

    def __init__(self, config: Config):
        super().__init__()
        self.w1 = config.w1.build()
        self.w2 = config.w2.build()
        self.w3 = config.w3.build()
        self.canonD = config.canonD.build() if config.canonD is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.canonD is not None:
            return self.w2(self.canonD.swiglu(gate, up))
        return self.w2(F.silu(gate) * up)


class LlamaBlock(Module):
    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        attention: Attention.Config
        feed_forward: FeedForward.Config
        attention_norm: RMSNorm.Config
        ffn_norm: RMSNorm.Config
        canonA: CanonConv.Config | None = None
        canonC: CanonConv.Config | None = None

    def __init__(self, config: Config):
        super().__init__()
        self.attention_norm = config.attention_norm.build()
        self.attention = config.attention.build()
        self.ffn_norm = config.ffn_norm.build()
        self.feed_forward = config.feed_forward.build()
        self.canonA = config.canonA.build() if config.canonA is not None else None
        self.canonC = config.canonC.build() if config.canonC is not None else None

    def forward(self, x: torch.Tensor, attention_masks=None, positions: torch.Tensor | None = None):
        # Canon-A/C apply the norm before them themselves (fused).
        a = self.canonA(x, self.attention_norm) if self.canonA is not None else self.attention_norm(x)
        h = x + self.attention(a, positions)
        m = self.canonC(h, self.ffn_norm) if self.canonC is not None else self.ffn_norm(h)
        return h + self.feed_forward(m)


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
        if self.rope_theta <= 0:
            problems.append(("rope_theta", f"must be > 0, got {self.rope_theta}"))
        if self.ffn_hidden_dim is not None and self.ffn_hidden_dim <= 0:
            problems.append(("ffn_hidden_dim", "must be > 0 (or unset for the 8/3 rule)"))
        return problems

    def canon(self, position: str, channels: int) -> CanonConv.Config | None:
        """The Canon layer at ``position`` (one of ABCD), or None; plain Llama has none."""
        return None

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
                canonB=self.canon("B", n_q + 2 * n_kv),
            ),
            feed_forward=FeedForward.Config(
                w1=Linear.Config(in_features=dim, out_features=hidden, param_init=linear_init),
                w3=Linear.Config(in_features=dim, out_features=hidden, param_init=linear_init),
                w2=Linear.Config(
                    in_features=hidden, out_features=dim, param_init=truncated_normal_init(hidden**-0.5)
                ),
                canonD=self.canon("D", 2 * hidden),
            ),
            canonA=self.canon("A", dim),
            canonC=self.canon("C", dim),
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


@dataclass(kw_only=True)
class LlamaCanonArgs(LlamaArgs):
    canon_set: str = "ABCD"
    """Canon positions to enable: any subset of "ABCD" ("" = plain Llama)."""
    canon_kernel: int = 4
    canon_residual: bool = True
    canon_activation: bool = False
    canon_bias: bool = False
    canon_backend: str = "auto"
    """'auto' (the Triton kernels on a CUDA GPU, else torch), 'torch' or 'triton'."""

    def validate(self) -> list[tuple[str, str]]:
        problems = LlamaArgs.validate(self)
        bad = [c for c in self.canon_set if c not in CANON_POSITIONS]
        if bad or len(set(self.canon_set)) != len(self.canon_set):
            problems.append(("canon_set", f"must be distinct letters from {CANON_POSITIONS!r}, got {self.canon_set!r}"))
        if self.canon_kernel not in (2, 3, 4):
            problems.append(("canon_kernel", f"must be 2, 3 or 4, got {self.canon_kernel}"))
        return problems + backend_problems(self.canon_backend, self.canon_kernel)

    def canon(self, position: str, channels: int) -> CanonConv.Config | None:
        if position not in self.canon_set:
            return None
        kernel = self.canon_kernel
        return CanonConv.Config(
            channels=channels,
            kernel_size=kernel,
            residual=self.canon_residual,
            activation=self.canon_activation,
            bias=self.canon_bias,
            backend=resolve_backend(self.canon_backend, kernel),
            param_init={"weight": canon_weight_init, "bias": partial(canon_bias_init, kernel_size=kernel)},
        )

    def model_config(self) -> LlamaModel.Config:
        if self.canon_set:
            backend = resolve_backend(self.canon_backend, self.canon_kernel)
            logger.info(f"Canon layers {self.canon_set!r}: kernel {self.canon_kernel}, residual "
                        f"{self.canon_residual}, activation {self.canon_activation}, bias {self.canon_bias}, "
                        f"backend {backend} (requested {self.canon_backend})")
        return LlamaArgs.model_config(self)
