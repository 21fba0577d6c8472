"""GLACanon configuration (PhysicsLM4 release format: GLA5 with Canon layers), for transformers 5.x.

Fields and defaults are the release's ``GLACanonConfig``; GLA5 sets expand_k 1, expand_v 2,
output_gate_rank 16 and intermediate_size 2 * hidden_size. ``canon_set`` letters: A, C, D Canon
layers, b ("bb" in the release's names) the short convolutions on q, k, v (``use_short_conv``).
"""

from transformers import PretrainedConfig


class GLACanonConfig(PretrainedConfig):
    model_type = "GLACanon"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 2048
    expand_k: float = 0.5
    expand_v: float = 1.0
    hidden_ratio: int | None = 4
    intermediate_size: int | None = None
    """SwiGLU width; None = int(hidden_size * hidden_ratio * 2 / 3) rounded up to a multiple of
    256."""
    num_hidden_layers: int = 24
    num_heads: int = 4
    num_kv_heads: int | None = None
    feature_map: str | None = None
    use_short_conv: bool = False
    conv_size: int = 4
    use_output_gate: bool = True
    output_gate_rank: int | None = None
    """Rank of the output-gate projection g_proj (GLA5: 16); None = a full matrix without bias."""
    clamp_min: float | None = None
    hidden_act: str = "swish"
    max_position_embeddings: int = 2048
    norm_eps: float = 1e-6
    use_gk: bool = True
    use_gv: bool = False
    attn: dict | None = None
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    zeyuan_layernorm: bool = False
    """Only renames the output gated norm (``attn.g_norm`` instead of
    ``attn.g_norm_swish_gate``)."""
    canon_set: str = ""
    canon_kernel: int = 4
    canon_residual: bool = True
    canon_activation: bool = False
    canon_bias: bool = False

    def __post_init__(self, **kwargs):
        if self.intermediate_size is None:
            self.intermediate_size = 256 * -(
                -int(self.hidden_size * (self.hidden_ratio or 4) * 2 / 3) // 256
            )
        unsupported = {
            "feature_map": self.feature_map is not None,
            "num_kv_heads": self.num_kv_heads not in (None, self.num_heads),
            "use_gk": not self.use_gk,
            "use_gv": self.use_gv,
            "use_output_gate": not self.use_output_gate,
            "attn": self.attn is not None,
            "hidden_act": self.hidden_act not in ("swish", "silu"),
            "canon_set": any(c not in "AbCD" for c in self.canon_set),
        }
        for name, bad in unsupported.items():
            if bad:
                raise ValueError(
                    f"GLACanonConfig: {name}={getattr(self, name)!r} is not supported by this code"
                )
        super().__post_init__(**kwargs)
