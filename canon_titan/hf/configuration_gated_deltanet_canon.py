"""GatedDeltaNetCanon configuration (PhysicsLM4 release format: GDN2 with Canon layers), for
transformers 5.x.

Fields and defaults are the release's ``GatedDeltaNetCanonConfig``; GDN2 sets head_dim =
hidden_size / num_heads, expand_v 2, output_gate_rank 16 and intermediate_size 2 * hidden_size.
``canon_set`` letters: A, C, D Canon layers, b ("bb" in the release's names) the short
convolutions on q, k, v (``use_short_conv``).
"""

from transformers import PretrainedConfig


class GatedDeltaNetCanonConfig(PretrainedConfig):
    model_type = "GatedDeltaNetCanon"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 2048
    expand_v: float = 2
    use_gate: bool = True
    output_gate_rank: int | None = None
    """Rank of the output-gate projection g_proj (GDN2: 16); None = a full matrix without bias."""
    use_short_conv: bool = True
    conv_size: int = 4
    head_dim: int = 256
    num_heads: int = 6
    max_position_embeddings: int = 2048
    hidden_ratio: int | None = 4
    intermediate_size: int | None = None
    """SwiGLU width; None = int(hidden_size * hidden_ratio * 2 / 3) rounded up to a multiple of
    256."""
    hidden_act: str = "swish"
    num_hidden_layers: int = 21
    norm_eps: float = 1e-6
    attn: dict | None = None
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    zeyuan_layernorm: bool = False
    """The release builds unfused norms with it; here the norms and their names are the same either
    way."""
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
            "use_gate": not self.use_gate,
            "attn": self.attn is not None,
            "hidden_act": self.hidden_act not in ("swish", "silu"),
            "canon_set": any(c not in "AbCD" for c in self.canon_set),
        }
        for name, bad in unsupported.items():
            if bad:
                raise ValueError(
                    f"GatedDeltaNetCanonConfig: {name}={getattr(self, name)!r} is not supported "
                    "by this code"
                )
        super().__post_init__(**kwargs)
