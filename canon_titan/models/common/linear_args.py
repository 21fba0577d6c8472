"""The ``[model]`` args every linear family (GLA5, GDN2, Mamba2) shares, and GLA5's and GDN2's
common part; ``models/common/linear.py`` has the modules they build (and the ``canon_set`` letters).
Importing this does not import the model stack (``models/common/deferred.py``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import torch.nn as nn
from torchtitan.tools.logging import logger

from canon_titan.kernels.backends import CUDA_BACKENDS, resolve_backend
from canon_titan.models.common.canon_args import CanonArgs, conv_backend
from canon_titan.models.common.deferred import deferred
from canon_titan.models.common.init import ONES_INIT, normal_init, split_init

if TYPE_CHECKING:
    from torchtitan.protocols.module import Module

canon_layer = deferred("canon_titan.models.common.canon")
decoder = deferred("canon_titan.models.common.decoder")
linear = deferred("canon_titan.models.common.linear")
norms = deferred("canon_titan.models.common.norms")
titan = deferred("torchtitan.models.common")

SHORT_CONV_SIZE = 4
"""Kernel of the built-in short convolution (b): conv_size / conv_kernel 4 in every release
config."""


@dataclass(kw_only=True)
class LinearArgs(CanonArgs, ABC):
    """The TOML ``[model]`` keys every linear family has; subclasses add theirs and build the
    mixer."""

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
    """Recurrence kernel: 'auto' (the Triton kernel on a GPU when its package imports and works
    there, else torch), 'torch', or the family's kernel package ('fla' for GLA5/GDN2, 'mamba_ssm'
    for Mamba2)."""
    seed: int | None = None
    """Seed of the weight initialisation (None: ``[job] seed``), as Llama's; the release recipes set
    42."""

    label: ClassVar[str] = "linear"
    kernel_op: ClassVar[str] = ""
    """The kernel this family's mixer runs (canon_titan.kernels op name)."""
    canon_letters: ClassVar[str] = "AbCD"
    canon_set_note: ClassVar[str] = " ('bb' counts as b)"
    no_tensor_parallel: ClassVar[str | None] = None
    """Why this family has no tensor parallelism, or None when it has."""
    unset_values: ClassVar[dict[str, str]] = {"ffn_hidden_dim": "hidden_dim"}
    """As Llama's: a field whose None leaves its value to a rule -> the property holding it."""

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
            problems.append(
                (
                    "kernel_backend",
                    f"must be one of {', '.join(map(repr, allowed))} for {self.label}, "
                    f"got {self.kernel_backend!r}",
                )
            )
        else:
            try:
                resolve_backend(self.kernel_backend, op=self.kernel_op)
            except ValueError as e:
                problems.append(("kernel_backend", str(e)))
        return problems

    def canon_problems(self) -> list[tuple[str, str]]:
        problems = CanonArgs.canon_problems(self)
        if "B" in self.enabled():
            problems = [
                (
                    "canon_set",
                    f"Canon-B is not available for {self.label}: the release trains these models "
                    "with b (the built-in short convolution), e.g. 'AbbCD' or 'bb'",
                )
            ] + [(key, message) for key, message in problems if key != "canon_set"]
        return problems

    def context_parallel_problem(self, cp: int) -> str | None:
        if cp > 1:
            return (
                f"{self.label} has no context-parallel path: its recurrence carries a "
                "state along the "
                "whole sequence, so a rank's share would need the final state of the "
                "shares before it "
                "(fla's context-parallel kernels are not wired in). Split long sequences "
                "with FSDP, TP "
                "or PP instead, or train llama/llama_canon with context parallelism"
            )
        return None

    def tensor_parallel_problem(self, tp: int) -> str | None:
        if tp > 1 and self.no_tensor_parallel:
            return self.no_tensor_parallel
        if self.n_heads % tp:
            return f"({tp}) must divide model n_heads ({self.n_heads})"
        return None

    # --- pieces the families combine --------------------------------------------------------

    def short_conv(
        self, channels: int, *, bias: bool, param_init: dict
    ) -> canon_layer.CanonConv.Config | None:
        """The built-in short convolution (b) over ``channels``, or None without b."""
        if "b" not in self.enabled():
            return None
        return canon_layer.CanonConv.Config(
            channels=channels,
            kernel_size=SHORT_CONV_SIZE,
            residual=False,
            activation=True,
            bias=bias,
            backend=conv_backend(self.canon_backend),
            param_init=param_init,
        )

    @abstractmethod
    def linear_init(self) -> dict: ...

    @abstractmethod
    def embedding_std(self) -> float: ...

    @abstractmethod
    def mixer_config(self, kernel_backend: str) -> Module.Config: ...

    def block_config(self, kernel_backend: str) -> linear.LinearBlock.Config:
        dim, init = self.dim, self.linear_init()
        norm = partial(norms.RMSNorm.Config, dim=dim, eps=self.norm_eps, param_init=ONES_INIT)
        return linear.LinearBlock.Config(
            mixer_norm=norm(),
            mixer=self.mixer_config(kernel_backend),
            ffn_norm=norm(),
            feed_forward=decoder.swiglu(
                dim, self.hidden_dim, init, init, self.canon("D", 2 * self.hidden_dim)
            ),
            canonA=self.canon("A", dim),
            canonC=self.canon("C", dim),
        )

    def model_config(self) -> linear.LinearLM.Config:
        kernel_backend, why_not = resolve_backend(
            self.kernel_backend, op=self.kernel_op, check=False
        )
        if why_not and why_not != "no GPU":
            logger.warning(
                f"{self.label}: kernel_backend 'auto' runs {self.kernel_op} with torch: {why_not}"
            )
        canon = f"; {self.describe_canon()}" if self.canon_set else ""
        logger.info(
            f"{self.label}: {self.kernel_op} kernel backend {kernel_backend} "
            f"(requested {self.kernel_backend}){canon}"
        )
        embedding_init = {"weight": partial(nn.init.normal_, std=self.embedding_std())}
        return linear.LinearLM.Config(
            **decoder.decoder_parts(
                self.dim, self.vocab_size, self.norm_eps, embedding_init, self.linear_init()
            ),
            layers=[self.block_config(kernel_backend) for _ in range(self.n_layers)],
            args=self,
        )


INIT_STD = 0.02
"""initializer_range of GLA5 and GDN2."""
GATE_RANK = 16
"""Rank of their low-rank gate projections (GLA5's forget gate, both families' output gate)."""


@dataclass(kw_only=True)
class FlaLayerArgs(LinearArgs, ABC):
    """GLA5 and GDN2, built like flash-linear-attention's layers: key width d and value width 2d in
    ``n_heads`` heads, q/k/v/o projections and short convolutions initialised N(0, 0.02), a
    low-rank output gate, a per-head gated RMSNorm."""

    zeyuan_layernorm: bool = False
    """The release's switch to unfused PyTorch RMSNorms in its Hugging Face classes (GLA5 then names
    its gated norm ``attn.g_norm``). The maths, and the model canon-titan trains, are the same
    either way; exports write it, so the release's class builds the modules its recipe trained with
    (true in the 8B GLA5/GDN2 recipes and GLA5Canon-3B-lr0.005)."""

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
            "q_proj": titan.Linear.Config(in_features=d, out_features=key_dim, param_init=init),
            "k_proj": titan.Linear.Config(in_features=d, out_features=key_dim, param_init=init),
            "v_proj": titan.Linear.Config(in_features=d, out_features=value_dim, param_init=init),
            "g_proj": linear.low_rank(d, GATE_RANK, value_dim, split_init(INIT_STD, GATE_RANK)),
            "o_proj": titan.Linear.Config(in_features=value_dim, out_features=d, param_init=init),
            "q_conv1d": self.short_conv(key_dim, bias=False, param_init=init),
            "k_conv1d": self.short_conv(key_dim, bias=False, param_init=init),
            "v_conv1d": self.short_conv(value_dim, bias=False, param_init=init),
        }

    def gated_norm(self) -> linear.GatedRMSNorm.Config:
        return linear.GatedRMSNorm.Config(
            dim=2 * self.dim // self.n_heads,
            eps=self.norm_eps,
            norm_before_gate=True,
            param_init=ONES_INIT,
        )
