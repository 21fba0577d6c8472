"""What the linear models of PhysicsLM4 Part 4.2 (GLA5, GDN2, Mamba2; spec section 5) share: the
LM, the block, the gated RMSNorm, the low-rank projection, and the args of their TOML ``[model]``.

Block (pre-norm, as the release's GLABlock / GatedDeltaNetCanonBlock / Mamba2CanonBlock):
    h = x + mixer(CanonA(mixer_norm(x)));    out = h + feed_forward(CanonC(ffn_norm(h)))
where the feed-forward is Llama's SwiGLU with Canon-D on [gate | up] (the release's fused
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

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.models.common import Linear
from torchtitan.models.common.decoder import Decoder
from torchtitan.protocols.module import Module
from torchtitan.tools.logging import logger

from canon_titan.kernels import resolve_backend as resolve_kernel_backend
from canon_titan.kernels.backends import CUDA_BACKENDS
from canon_titan.models.canon import CanonConv, backend_problems, canon_bias_init, canon_weight_init
from canon_titan.models.canon import resolve_backend as resolve_canon_backend
from canon_titan.models.llama import ONES_INIT, Embedding, FeedForward
from canon_titan.models.norms import RMSNorm
from canon_titan.models.tensor_parallel import local, sum_gradients

LINEAR_CANON_LETTERS = "AbCD"
SHORT_CONV_SIZE = 4
"""Kernel of the built-in short convolution (b): conv_size / conv_kernel 4 in every release config."""


def upcast(t: torch.Tensor) -> torch.Tensor:
    """float32 for half precision; float64 stays float64 (tests compare in double)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def normal_init(std: float) -> dict:
    """N(0, std) weights, zero biases: the release's ``_init_weights`` for GLA/GDN linears."""
    return {"weight": partial(nn.init.normal_, std=std), "bias": nn.init.zeros_}


def torch_default_init() -> dict:
    """PyTorch's own Linear/Conv1d init: U(+-1/sqrt(fan_in)) weights; Mamba2's linears (bias zero)."""
    return {"weight": canon_weight_init, "bias": nn.init.zeros_}


def split_init(std: float, rank: int) -> dict:
    """The release's ``zeyuan_split_init``: both factors of a rank-r product get std sqrt(std) / r^(1/4),
    so the product has about the variance of one full matrix with std ``std``."""
    return normal_init(math.sqrt(std) / rank**0.25)


class LowRankLinear(Module):
    """``up(down(x))``: a rank-r projection (the release's two-layer ``nn.Sequential``; ``up`` has a bias)."""

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

    ``norm_before_gate``: ``norm(x) * w * silu(g)`` (fla's FusedRMSNormSwishGate, per head, GLA5/GDN2);
    otherwise ``norm(x * silu(g)) * w`` (Mamba2's gated norm over the whole inner width).
    Under tensor parallelism each rank applies the shared weight to its own heads, so its gradient
    is summed over ``tp_group``.
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
        self.tp_group = None

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        weight = local(self.weight, x)
        if self.tp_group is not None:
            weight = sum_gradients(weight, self.tp_group)
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

    def forward(self, x: torch.Tensor, attention_masks=None, positions: torch.Tensor | None = None):
        # Same signature as the attention blocks. Document boundaries (positions restarting at 0)
        # are ignored: the recurrent state and the convolutions run across the documents of a
        # packed sequence, as in the release's training.
        # Canon-A/C apply the norm before them themselves (fused).
        a = self.canonA(x, self.mixer_norm) if self.canonA is not None else self.mixer_norm(x)
        h = x + self.mixer(a)
        m = self.canonC(h, self.ffn_norm) if self.canonC is not None else self.ffn_norm(h)
        return h + self.feed_forward(m)


class LinearLM(Decoder):
    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        @property
        def first_attention(self):
            # No attention layer: the trainer then builds no attention masks.
            return None

        def update_from_config(self, *, config, **kwargs) -> None:
            # Decoder's version reads the RoPE of the first attention layer; these models have none.
            tp = config.parallelism.tensor_parallel_degree
            mixer = self.layers[0].mixer
            if tp > 1 and not mixer.tensor_parallel:
                raise ValueError(f"{mixer.family} does not support tensor parallelism; "
                                 "use FSDP/HSDP and/or pipeline parallelism")
            if mixer.n_heads % tp:
                raise ValueError(f"parallelism.tensor_parallel_degree ({tp}) must divide model.n_heads "
                                 f"({mixer.n_heads})")

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            """6 FLOPs per parameter and token (the lm_head counted, the embedding lookup not), plus
            for the recurrence a state update and a read-out per token (2 multiply-adds per state
            entry, times 3 for forward and backward)."""
            nparams = sum(p.numel() for p in model.parameters())
            embedding = sum(p.numel() for m in model.children() if isinstance(m, nn.Embedding) for p in m.parameters())
            state = sum(layer.mixer.recurrent_state_size for layer in self.layers)
            return nparams, 6 * (nparams - embedding) + 12 * state


@dataclass(kw_only=True)
class LinearArgs(ABC):
    """The TOML ``[model]`` keys every linear family has; subclasses add theirs and build the mixer."""

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    ffn_hidden_dim: int | None = None
    """SwiGLU hidden size; None means 2 * dim (the release's 6 d^2 MLP)."""
    norm_eps: float = 1e-5
    z_loss: bool = False
    """Add the squared-NLL term ``1e-4 * l**2`` (the linear recipes leave it off)."""
    canon_set: str = "AbbCD"
    """Letters from "AbCD": A, C, D Canon layers, b the built-in short convolution ("bb" = "b")."""
    canon_kernel: int = 4
    canon_residual: bool = True
    canon_activation: bool = False
    canon_bias: bool = False
    canon_backend: str = "auto"
    """Convolution backend of Canon A/C/D and of b: 'auto' (Triton on a CUDA GPU, else torch), 'torch' or
    'triton'."""
    kernel_backend: str = "auto"
    """Recurrence kernel: 'auto' (the Triton kernel on a GPU when its package imports and works there,
    else torch), 'torch', or the family's kernel package ('fla' for GLA5/GDN2, 'mamba_ssm' for Mamba2)."""

    family = "linear"
    kernel_op = ""
    """The kernel this family's mixer runs (canon_titan.kernels op name)."""

    @property
    def kv_heads(self) -> int:
        return self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim or 2 * self.dim

    def validate(self) -> list[tuple[str, str]]:
        """Problems as (field, message) pairs; empty when the shape is buildable."""
        problems = []
        for name in ("dim", "n_layers", "n_heads", "vocab_size"):
            if getattr(self, name) <= 0:
                problems.append((name, "must be > 0"))
        if self.ffn_hidden_dim is not None and self.ffn_hidden_dim <= 0:
            problems.append(("ffn_hidden_dim", "must be > 0 (or unset for 2 * dim)"))
        if self.norm_eps <= 0:
            problems.append(("norm_eps", "must be > 0"))
        problems += self._validate_canon()
        allowed = ("auto", "torch", CUDA_BACKENDS[self.kernel_op])
        if self.kernel_backend not in allowed:
            problems.append(("kernel_backend", f"must be one of {', '.join(map(repr, allowed))} for {self.family}, "
                                               f"got {self.kernel_backend!r}"))
        else:
            try:
                resolve_kernel_backend(self.kernel_backend, op=self.kernel_op)
            except ValueError as e:
                problems.append(("kernel_backend", str(e)))
        return problems

    def _validate_canon(self) -> list[tuple[str, str]]:
        problems = []
        letters = self.canon_set.replace("bb", "b")
        if "B" in letters:
            problems.append(("canon_set", f"Canon-B is not available for {self.family}: the release trains these "
                                          "models with b (the built-in short convolution), e.g. 'AbbCD' or 'bb'"))
        elif any(c not in LINEAR_CANON_LETTERS for c in letters) or len(set(letters)) != len(letters):
            problems.append(("canon_set", f"must be distinct letters from {LINEAR_CANON_LETTERS!r} ('bb' counts as b), "
                                          f"got {self.canon_set!r}"))
        if self.canon_kernel not in (2, 3, 4):
            problems.append(("canon_kernel", f"must be 2, 3 or 4, got {self.canon_kernel}"))
        return problems + backend_problems(self.canon_backend, self.canon_kernel)

    # --- pieces the families combine --------------------------------------------------------

    def canon(self, position: str, channels: int) -> CanonConv.Config | None:
        """The Canon layer at ``position`` (A, C or D), or None."""
        if position not in self.canon_set:
            return None
        kernel = self.canon_kernel
        return CanonConv.Config(
            channels=channels, kernel_size=kernel, residual=self.canon_residual, activation=self.canon_activation,
            bias=self.canon_bias, backend=resolve_canon_backend(self.canon_backend, kernel),
            param_init={"weight": canon_weight_init, "bias": partial(canon_bias_init, kernel_size=kernel)},
        )

    def short_conv(self, channels: int, *, bias: bool, param_init: dict) -> CanonConv.Config | None:
        """The built-in short convolution (b) over ``channels``, or None without b."""
        if "b" not in self.canon_set:
            return None
        return CanonConv.Config(
            channels=channels, kernel_size=SHORT_CONV_SIZE, residual=False, activation=True, bias=bias,
            backend=resolve_canon_backend(self.canon_backend, SHORT_CONV_SIZE), param_init=param_init,
        )

    @abstractmethod
    def linear_init(self) -> dict: ...

    @abstractmethod
    def embedding_std(self) -> float: ...

    @abstractmethod
    def mixer_config(self, kernel_backend: str) -> Module.Config: ...

    def block_config(self, kernel_backend: str) -> LinearBlock.Config:
        dim, hidden, init = self.dim, self.hidden_dim, self.linear_init()
        norm = partial(RMSNorm.Config, dim=dim, eps=self.norm_eps, param_init=ONES_INIT)
        return LinearBlock.Config(
            mixer_norm=norm(),
            mixer=self.mixer_config(kernel_backend),
            ffn_norm=norm(),
            feed_forward=FeedForward.Config(
                w1=Linear.Config(in_features=dim, out_features=hidden, param_init=init),
                w3=Linear.Config(in_features=dim, out_features=hidden, param_init=init),
                w2=Linear.Config(in_features=hidden, out_features=dim, param_init=init),
                canonD=self.canon("D", 2 * hidden),
            ),
            canonA=self.canon("A", dim),
            canonC=self.canon("C", dim),
        )

    def model_config(self) -> LinearLM.Config:
        kernel_backend, why_not = resolve_kernel_backend(self.kernel_backend, op=self.kernel_op)
        canon = ""
        if self.canon_set:
            canon = (f"; canon_set {self.canon_set!r} (kernel {self.canon_kernel}, residual {self.canon_residual}, "
                     f"activation {self.canon_activation}, bias {self.canon_bias}), conv backend "
                     f"{resolve_canon_backend(self.canon_backend, self.canon_kernel)} (requested {self.canon_backend})")
        if why_not and why_not != "no GPU":
            logger.warning(f"{self.family}: kernel_backend 'auto' runs {self.kernel_op} with torch: {why_not}")
        logger.info(f"{self.family}: {self.kernel_op} kernel backend {kernel_backend} "
                    f"(requested {self.kernel_backend}){canon}")
        dim = self.dim
        return LinearLM.Config(
            dim=dim,
            vocab_size=self.vocab_size,
            tok_embeddings=Embedding.Config(
                num_embeddings=self.vocab_size, embedding_dim=dim,
                param_init={"weight": partial(nn.init.normal_, std=self.embedding_std())},
            ),
            norm=RMSNorm.Config(dim=dim, eps=self.norm_eps, param_init=ONES_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=self.vocab_size, param_init=self.linear_init()),
            layers=[self.block_config(kernel_backend) for _ in range(self.n_layers)],
        )
