"""What the linear models of PhysicsLM4 Part 4.2 (GLA5, GDN2, Mamba2; spec section 5) share: the
LM, the block, the gated RMSNorm, the low-rank projection, and the args of their TOML ``[model]``.

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

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.models.common import Linear
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.utils import get_dense_model_nparams_and_flops
from torchtitan.protocols.module import Module
from torchtitan.tools.logging import logger

from canon_titan.kernels.backends import CUDA_BACKENDS, resolve_backend
from canon_titan.models.common.canon import CanonArgs, CanonConv, canon_weight_init, conv_backend
from canon_titan.models.common.decoder import ONES_INIT, CanonDecoder, FeedForward, decoder_parts, normed, swiglu
from canon_titan.models.common.norms import RMSNorm
from canon_titan.models.common.tensor_parallel import local, sum_gradients

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


@torch.no_grad()
def log_uniform_init(param: torch.Tensor, low: float, high: float) -> None:
    """log U(low, high), in place (works on sharded DTensors too): GDN2's and Mamba2's A_log."""
    nn.init.uniform_(param, low, high).log_()


@torch.no_grad()
def dt_bias_init(param: torch.Tensor, dt_min: float = 0.001, dt_max: float = 0.1, floor: float = 1e-4) -> None:
    """softplus^-1(dt) for dt log-uniform in [dt_min, dt_max], floored (Mamba2's time-step init)."""
    nn.init.uniform_(param, math.log(dt_min), math.log(dt_max)).exp_().clamp_(min=floor)
    param.copy_(param + torch.log(-torch.expm1(-param)))


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
        h = x + self.mixer(normed(x, self.mixer_norm, self.canonA))
        return h + self.feed_forward(normed(h, self.ffn_norm, self.canonC))


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
            nparams, flops = get_dense_model_nparams_and_flops(model, n_layers=len(self.layers), n_heads=0,
                                                               head_dims=0, seq_len=seq_len)
            return nparams, flops + 12 * sum(layer.mixer.recurrent_state_size for layer in self.layers)


@dataclass(kw_only=True)
class LinearArgs(CanonArgs, ABC):
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
    kernel_backend: str = "auto"
    """Recurrence kernel: 'auto' (the Triton kernel on a GPU when its package imports and works there,
    else torch), 'torch', or the family's kernel package ('fla' for GLA5/GDN2, 'mamba_ssm' for Mamba2)."""

    label: ClassVar[str] = "linear"
    kernel_op: ClassVar[str] = ""
    """The kernel this family's mixer runs (canon_titan.kernels op name)."""
    canon_letters: ClassVar[str] = "AbCD"
    canon_set_note: ClassVar[str] = " ('bb' counts as b)"
    no_tensor_parallel: ClassVar[str | None] = None
    """Why this family has no tensor parallelism, or None when it has."""
    document_masking: ClassVar[str | None] = (
        "the linear models carry their recurrent state across packed documents, as the release does; they "
        "cannot restart it at a BOS (set false)")

    @property
    def kv_heads(self) -> int:
        return self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim or 2 * self.dim

    def enabled(self) -> set[str]:
        return set(self.canon_set.replace("bb", "b"))

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
        problems += self.canon_problems()
        allowed = ("auto", "torch", CUDA_BACKENDS[self.kernel_op])
        if self.kernel_backend not in allowed:
            problems.append(("kernel_backend", f"must be one of {', '.join(map(repr, allowed))} for {self.label}, "
                                               f"got {self.kernel_backend!r}"))
        else:
            try:
                resolve_backend(self.kernel_backend, op=self.kernel_op)
            except ValueError as e:
                problems.append(("kernel_backend", str(e)))
        return problems

    def canon_problems(self) -> list[tuple[str, str]]:
        problems = CanonArgs.canon_problems(self)
        if "B" in self.enabled():
            problems = [("canon_set", f"Canon-B is not available for {self.label}: the release trains these models "
                                      "with b (the built-in short convolution), e.g. 'AbbCD' or 'bb'")] + [
                (key, message) for key, message in problems if key != "canon_set"]
        return problems

    def context_parallel_problem(self, cp: int) -> str | None:
        if cp > 1:
            return (f"{self.label} has no context-parallel path: its recurrence carries a state along the "
                    "whole sequence, so a rank's share would need the final state of the shares before it "
                    "(fla's context-parallel kernels are not wired in). Split long sequences with FSDP, TP "
                    "or PP instead, or train llama/llama_canon with context parallelism")
        return None

    def tensor_parallel_problem(self, tp: int) -> str | None:
        if tp > 1 and self.no_tensor_parallel:
            return self.no_tensor_parallel
        if self.n_heads % tp:
            return f"({tp}) must divide model n_heads ({self.n_heads})"
        return None

    # --- pieces the families combine --------------------------------------------------------

    def short_conv(self, channels: int, *, bias: bool, param_init: dict) -> CanonConv.Config | None:
        """The built-in short convolution (b) over ``channels``, or None without b."""
        if "b" not in self.enabled():
            return None
        return CanonConv.Config(
            channels=channels, kernel_size=SHORT_CONV_SIZE, residual=False, activation=True, bias=bias,
            backend=conv_backend(self.canon_backend), param_init=param_init,
        )

    @abstractmethod
    def linear_init(self) -> dict: ...

    @abstractmethod
    def embedding_std(self) -> float: ...

    @abstractmethod
    def mixer_config(self, kernel_backend: str) -> Module.Config: ...

    def block_config(self, kernel_backend: str) -> LinearBlock.Config:
        dim, init = self.dim, self.linear_init()
        norm = partial(RMSNorm.Config, dim=dim, eps=self.norm_eps, param_init=ONES_INIT)
        return LinearBlock.Config(
            mixer_norm=norm(),
            mixer=self.mixer_config(kernel_backend),
            ffn_norm=norm(),
            feed_forward=swiglu(dim, self.hidden_dim, init, init, self.canon("D", 2 * self.hidden_dim)),
            canonA=self.canon("A", dim),
            canonC=self.canon("C", dim),
        )

    def model_config(self) -> LinearLM.Config:
        kernel_backend, why_not = resolve_backend(self.kernel_backend, op=self.kernel_op, check=False)
        if why_not and why_not != "no GPU":
            logger.warning(f"{self.label}: kernel_backend 'auto' runs {self.kernel_op} with torch: {why_not}")
        canon = f"; {self.describe_canon()}" if self.canon_set else ""
        logger.info(f"{self.label}: {self.kernel_op} kernel backend {kernel_backend} "
                    f"(requested {self.kernel_backend}){canon}")
        embedding_init = {"weight": partial(nn.init.normal_, std=self.embedding_std())}
        return LinearLM.Config(
            **decoder_parts(self.dim, self.vocab_size, self.norm_eps, embedding_init, self.linear_init()),
            layers=[self.block_config(kernel_backend) for _ in range(self.n_layers)],
            args=self,
        )


INIT_STD = 0.02
"""initializer_range of GLA5 and GDN2."""
GATE_RANK = 16
"""Rank of their low-rank gate projections (GLA5's forget gate, both families' output gate)."""


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
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (c.build() if c is not None else None for c in convs)

    @abstractmethod
    def build_projections(self, config: Config) -> None: ...

    @abstractmethod
    def build_norm(self, config: Config) -> None: ...

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v = SiLU(b(W x)) with the short convolutions b, else SiLU(W x)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_conv1d is not None:
            return self.q_conv1d(q), self.k_conv1d(k), self.v_conv1d(v)
        return F.silu(q), F.silu(k), F.silu(v)


@dataclass(kw_only=True)
class FlaLayerArgs(LinearArgs, ABC):
    """GLA5 and GDN2, built like flash-linear-attention's layers: key width d and value width 2d in
    ``n_heads`` heads, q/k/v/o projections and short convolutions initialised N(0, 0.02), a
    low-rank output gate, a per-head gated RMSNorm."""

    def validate(self) -> list[tuple[str, str]]:
        problems = LinearArgs.validate(self)
        if self.n_heads > 0 and self.dim % self.n_heads:
            problems.append(("n_heads", f"must divide dim ({self.dim})"))
        return problems

    def linear_init(self) -> dict:
        return normal_init(INIT_STD)

    def embedding_std(self) -> float:
        return INIT_STD

    def attention_parts(self) -> dict:
        """The projections, short convolutions, output gate and gated norm, as Config keywords."""
        d, init = self.dim, normal_init(INIT_STD)
        key_dim, value_dim = d, 2 * d
        return {
            "q_proj": Linear.Config(in_features=d, out_features=key_dim, param_init=init),
            "k_proj": Linear.Config(in_features=d, out_features=key_dim, param_init=init),
            "v_proj": Linear.Config(in_features=d, out_features=value_dim, param_init=init),
            "g_proj": low_rank(d, GATE_RANK, value_dim, split_init(INIT_STD, GATE_RANK)),
            "o_proj": Linear.Config(in_features=value_dim, out_features=d, param_init=init),
            "q_conv1d": self.short_conv(key_dim, bias=False, param_init=init),
            "k_conv1d": self.short_conv(key_dim, bias=False, param_init=init),
            "v_conv1d": self.short_conv(value_dim, bias=False, param_init=init),
        }

    def gated_norm(self) -> GatedRMSNorm.Config:
        return GatedRMSNorm.Config(dim=2 * self.dim // self.n_heads, eps=self.norm_eps, norm_before_gate=True,
                                   param_init=ONES_INIT)
