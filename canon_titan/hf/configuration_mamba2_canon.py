"""Mamba2Canon configuration (PhysicsLM4 release format: Mamba2 with a SwiGLU MLP "mlp10" and
Canon layers), for transformers 5.x.

Fields and defaults are the release's ``Mamba2CanonConfig``; its recipes set n_groups 1,
head_dim 2 * hidden_size / num_heads, state_size 128 and intermediate_size None (= 2 * hidden_size).
``canon_set`` letters: A, C, D Canon layers, b ("bb" in the release's names) Mamba2's own
convolution over x|B|C; without b (``noconv1d``) x|B|C passes unchanged (the release's frozen
identity kernel [0, 0, 0, 1], no bias, no activation).
"""

from transformers import PretrainedConfig


class Mamba2CanonConfig(PretrainedConfig):
    model_type = "Mamba2Canon"
    keys_to_ignore_at_inference = ["past_key_values"]

    num_heads: int = 128
    head_dim: int = 64
    vocab_size: int = 32768
    hidden_size: int = 4096
    state_size: int = 128
    num_hidden_layers: int = 64
    layer_norm_epsilon: float = 1e-5
    pad_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    expand: int = 2
    conv_kernel: int = 4
    n_groups: int = 8
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    initializer_range: float = 0.1
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_limit: list[float] | tuple[float, ...] = (0.0, float("inf"))
    use_cache: bool = True
    chunk_size: int = 256
    tie_word_embeddings: bool = False
    intermediate_size: int | None = None
    """SwiGLU width of the MLP; None = 2 * hidden_size."""
    mlp_type: str | None = "mlp10"
    noconv1d: bool = False
    canon_set: str = ""
    canon_kernel: int = 4
    canon_residual: bool = True
    canon_activation: bool = False
    canon_bias: bool = False

    def __post_init__(self, **kwargs):
        if self.intermediate_size is None:
            self.intermediate_size = 2 * self.hidden_size
        unsupported = {
            "mlp_type": self.mlp_type != "mlp10",
            "hidden_act": self.hidden_act not in ("swish", "silu"),
            "use_conv_bias": self.noconv1d and self.use_conv_bias,
            "canon_set": any(c not in "AbCD" for c in self.canon_set),
        }
        for name, bad in unsupported.items():
            if bad:
                raise ValueError(
                    f"Mamba2CanonConfig: {name}={getattr(self, name)!r} is not supported "
                    "by this code"
                )
        if self.expand * self.hidden_size != self.num_heads * self.head_dim:
            raise ValueError(
                f"Mamba2CanonConfig: expand * hidden_size ({self.expand * self.hidden_size}) must "
                f"equal num_heads * head_dim ({self.num_heads * self.head_dim})"
            )
        super().__post_init__(**kwargs)
