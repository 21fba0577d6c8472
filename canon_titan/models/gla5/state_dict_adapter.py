"""Hugging Face format of GLA5: the release's ``GLACanon`` (``GLACanonForCausalLM``)."""

from __future__ import annotations

from canon_titan.hf import HFModel
from canon_titan.models.common.linear_args import GATE_RANK, INIT_STD, SHORT_CONV_SIZE
from canon_titan.models.common.linear_state_dict_adapter import (
    LINEAR_SHARED,
    LOW_RANK,
    LinearStateDictAdapter,
)


class GLA5StateDictAdapter(LinearStateDictAdapter):
    classes = HFModel(
        "configuration_gla_canon.GLACanonConfig",
        "modeling_gla_canon.GLACanonForCausalLM",
        LINEAR_SHARED,
    )
    block_names = {
        "mixer": "attn",
        "mixer_norm": "attn_norm",
        "ffn_norm": "mlp_norm",
        "mixer.g_norm": "attn.g_norm_swish_gate",
        **LOW_RANK,
    }

    def __init__(
        self, model_config, hf_assets_path: str | None = None, *, rope_layout: str = "lingua"
    ):
        super().__init__(model_config, hf_assets_path, rope_layout=rope_layout)
        self.plain_gate_norm = self.args.zeyuan_layernorm
        """With ``zeyuan_layernorm`` the release names its gated norm ``attn.g_norm``: the run's
        choice for exports; an imported folder's config.json decides for its tensors."""

    def names(self) -> dict[str, str]:
        names = super().names()
        if self.plain_gate_norm:
            names["mixer.g_norm"] = "attn.g_norm"
        return names

    def fused_mlp(self) -> str:
        return "gate_proj"

    def read_format(self, hf: dict, where: str) -> None:
        self.plain_gate_norm = bool(hf.get("zeyuan_layernorm"))

    def hf_fields(self) -> dict:
        args = self.args
        return {
            "hidden_size": args.dim,
            "expand_k": 1,
            "expand_v": 2,
            "hidden_ratio": 4,
            "intermediate_size": args.hidden_dim,
            "num_hidden_layers": args.n_layers,
            "num_heads": args.n_heads,
            "num_kv_heads": None,
            "feature_map": None,
            "attn_mode": "chunk",
            "use_short_conv": "b" in args.enabled(),
            "conv_size": SHORT_CONV_SIZE,
            "use_output_gate": True,
            "output_gate_rank": GATE_RANK,
            "clamp_min": None,
            "hidden_act": "swish",
            "elementwise_affine": True,
            "norm_eps": args.norm_eps,
            "use_gk": True,
            "use_gv": False,
            "attn": None,
            "use_cache": True,
            "initializer_range": INIT_STD,
            "zeyuan_split_init": True,
            "zeyuan_layernorm": args.zeyuan_layernorm,
            "fuse_norm": True,
            "fuse_swiglu": True,
            "fuse_cross_entropy": False,
            "use_l2warp": False,
        }
