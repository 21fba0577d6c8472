"""Hugging Face format of GDN2: the release's ``GatedDeltaNetCanon``."""

from __future__ import annotations

from canon_titan.hf import HFModel
from canon_titan.models.common.linear_args import GATE_RANK, INIT_STD, SHORT_CONV_SIZE
from canon_titan.models.common.linear_state_dict_adapter import (
    LINEAR_SHARED,
    LOW_RANK,
    LinearStateDictAdapter,
)


class GDN2StateDictAdapter(LinearStateDictAdapter):
    classes = HFModel(
        "configuration_gated_deltanet_canon.GatedDeltaNetCanonConfig",
        "modeling_gated_deltanet_canon.GatedDeltaNetCanonForCausalLM",
        LINEAR_SHARED,
    )
    block_names = {"mixer": "attn", "mixer_norm": "attn_norm", "ffn_norm": "mlp_norm", **LOW_RANK}

    def fused_mlp(self) -> str | None:
        # The release fuses gate and up only when Canon-D reads them.
        return "both_proj" if "D" in self.args.enabled() else None

    def hf_fields(self) -> dict:
        args = self.args
        return {
            "attn_mode": "chunk",
            "hidden_size": args.dim,
            "expand_v": 2,
            "use_gate": True,
            "use_short_conv": "b" in args.enabled(),
            "conv_size": SHORT_CONV_SIZE,
            "head_dim": args.dim // args.n_heads,
            "num_heads": args.n_heads,
            "hidden_ratio": 4,
            "intermediate_size": args.hidden_dim,
            "hidden_act": "swish",
            "num_hidden_layers": args.n_layers,
            "norm_eps": args.norm_eps,
            "attn": None,
            "use_cache": True,
            "initializer_range": INIT_STD,
            "fuse_norm": True,
            "fuse_swiglu": True,
            "fuse_cross_entropy": False,
            "zeyuan_split_init": True,
            "output_gate_rank": GATE_RANK,
            "zeyuan_layernorm": args.zeyuan_layernorm,
        }
