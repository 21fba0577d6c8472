"""The ``[model]`` keys of a Llama: the flat, user-facing shape the model config is built from."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from canon_titan.models.common.deferred import deferred
from canon_titan.models.common.init import ONES_INIT, truncated_normal_init

canon_layer = deferred("canon_titan.models.common.canon")
decoder = deferred("canon_titan.models.common.decoder")
model = deferred("canon_titan.models.llama.model")
norms = deferred("canon_titan.models.common.norms")
rotary = deferred("canon_titan.models.common.rope")
titan = deferred("torchtitan.models.common")
feed_forward = deferred("torchtitan.models.common.feed_forward")


@dataclass(kw_only=True)
class LlamaArgs:
    """One TOML ``[model]`` key per field."""

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
    seed: int | None = None
    """Seed of the weight initialisation; None uses ``[job] seed``. The release recipes set 42 (the
    release's ``model.seed``; its run seed is 777)."""

    label: ClassVar[str] = "Llama"
    unset_values: ClassVar[dict[str, str]] = {
        "n_kv_heads": "kv_heads",
        "ffn_hidden_dim": "hidden_dim",
        "rope_dim": "head_dim",
    }
    """A field whose None leaves its value to a rule -> the property holding that value
    (``config show`` writes the value)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim or feed_forward.compute_ffn_hidden_dim(
            self.dim, multiple_of=self.multiple_of
        )

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

    def tensor_parallel_problem(self, tp: int) -> str | None:
        """Why ``tp``-way tensor parallelism cannot shard this model, or None."""
        for name, heads in (("n_heads", self.n_heads), ("n_kv_heads", self.kv_heads)):
            if heads % tp:
                return f"({tp}) must divide model {name} ({heads})"
        return None

    def context_parallel_problem(self, cp: int) -> str | None:
        """Why ``cp``-way context parallelism cannot split this model's sequences, or None:
        attention gathers K/V and Canon layers exchange halos
        (``models/common/context_parallel.py``)."""
        return None

    def canon(self, position: str, channels: int) -> canon_layer.CanonConv.Config | None:
        """The Canon layer at ``position`` (one of ABCD), or None; plain Llama has none."""
        return None

    def block_config(self) -> model.LlamaBlock.Config:
        dim, hd, hidden = self.dim, self.head_dim, self.hidden_dim
        n_q, n_kv = self.n_heads * hd, self.kv_heads * hd
        linear_init = truncated_normal_init(dim**-0.5)
        norm = partial(norms.RMSNorm.Config, eps=self.norm_eps, param_init=ONES_INIT)
        return model.LlamaBlock.Config(
            attention_norm=norm(dim=dim),
            ffn_norm=norm(dim=dim),
            attention=model.Attention.Config(
                dim=dim,
                n_heads=self.n_heads,
                n_kv_heads=self.kv_heads,
                head_dim=hd,
                wq=titan.Linear.Config(in_features=dim, out_features=n_q, param_init=linear_init),
                wk=titan.Linear.Config(in_features=dim, out_features=n_kv, param_init=linear_init),
                wv=titan.Linear.Config(in_features=dim, out_features=n_kv, param_init=linear_init),
                wo=titan.Linear.Config(in_features=n_q, out_features=dim, param_init=linear_init),
                rope=rotary.PartialRoPE.Config(
                    rope_dim=self.rope_dim or hd,
                    theta=self.rope_theta,
                    max_seq_len=self.max_seq_len,
                ),
                q_norm=norm(dim=n_q) if self.qk_norm else None,
                k_norm=norm(dim=n_kv) if self.qk_norm else None,
                canonB=self.canon("B", n_q + 2 * n_kv),
            ),
            feed_forward=decoder.swiglu(
                dim,
                hidden,
                linear_init,
                truncated_normal_init(hidden**-0.5),
                self.canon("D", 2 * hidden),
            ),
            canonA=self.canon("A", dim),
            canonC=self.canon("C", dim),
        )

    def model_config(self) -> model.LlamaModel.Config:
        init = truncated_normal_init(self.dim**-0.5)
        return model.LlamaModel.Config(
            **decoder.decoder_parts(self.dim, self.vocab_size, self.norm_eps, init, init),
            layers=[self.block_config() for _ in range(self.n_layers)],
            args=self,
        )
