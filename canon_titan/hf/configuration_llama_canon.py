"""LlamaCanon configuration (PhysicsLM4 release format), for transformers 5.x."""

from transformers import PretrainedConfig


class LlamaCanonConfig(PretrainedConfig):
    model_type = "LlamaCanon"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_dim: int | None = None
    """Channels per head that RoPE rotates (the first ones); None = partial_rotary_factor x
    head_dim."""
    partial_rotary_factor: float | None = None
    rope_version: str = "lingua"
    """'lingua': rotate interleaved pairs (2i, 2i+1); 'huggingface': rotate-half pairs (i, i +
    rope_dim/2)."""
    qk_norm: bool = False
    """One RMSNorm over the whole flat q (and k) projection, across heads."""
    canon_set: str = ""
    canon_kernel: int = 4
    canon_residual: bool = True
    canon_activation: bool = False
    canon_bias: bool = False

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.rope_dim is None:
            factor = self.partial_rotary_factor or 1.0
            self.rope_dim = int(self.head_dim * factor)
        self.partial_rotary_factor = self.rope_dim / self.head_dim
        if self.rope_version not in ("lingua", "huggingface"):
            raise ValueError(
                f"rope_version must be 'lingua' or 'huggingface', got {self.rope_version!r}"
            )
        if any(c not in "ABCD" for c in self.canon_set):
            raise ValueError(f"canon_set must be letters from 'ABCD', got {self.canon_set!r}")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(
                f"rope_dim must be even and in [2, head_dim={self.head_dim}], got {self.rope_dim}"
            )
        super().__post_init__(**kwargs)
