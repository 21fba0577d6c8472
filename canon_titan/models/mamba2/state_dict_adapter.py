"""Hugging Face format of Mamba2: the release's ``Mamba2Canon``. A model without b stores the
release's frozen identity convolution, which canon-titan does not have."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from canon_titan.hf import HFModel
from canon_titan.models.common.linear_args import SHORT_CONV_SIZE
from canon_titan.models.common.linear_state_dict_adapter import (
    LINEAR_SHARED,
    LinearStateDictAdapter,
)
from canon_titan.models.common.state_dict_adapter import LAYER, HFTensor
from canon_titan.models.mamba2.args import EMBEDDING_STD, EXPAND


class Mamba2StateDictAdapter(LinearStateDictAdapter):
    classes = HFModel(
        "configuration_mamba2_canon.Mamba2CanonConfig",
        "modeling_mamba2_canon.Mamba2CanonForCausalLM",
        LINEAR_SHARED,
    )
    backbone = "backbone"
    final_norm = "norm_f"
    block_names = {"mixer": "mixer", "mixer_norm": "norm", "ffn_norm": "pre_mlp_layernorm"}

    def identity_conv(self) -> torch.Tensor:
        """The kernel [0, 0, 0, 1] per x|B|C channel."""
        args = self.args
        kernel = torch.zeros(args.n_heads * args.head_dim + 2 * args.state_size, 1, SHORT_CONV_SIZE)
        kernel[:, :, -1] = 1.0
        return kernel

    def layout(self, names: Iterable[str]) -> dict[str, HFTensor]:
        names = list(names)
        layout = super().layout(names)
        if "b" not in self.args.enabled():
            layers = sorted({int(m.group(1)) for m in map(LAYER.match, names) if m}, key=int)
            for layer in layers:
                layout[f"backbone.layers.{layer}.mixer.conv1d.weight"] = HFTensor(
                    fixed=self.identity_conv()
                )
        return layout

    def hf_fields(self) -> dict:
        args = self.args
        b = "b" in args.enabled()
        return {
            "hidden_size": args.dim,
            "state_size": args.state_size,
            "num_hidden_layers": args.n_layers,
            "layer_norm_epsilon": args.norm_eps,
            "conv_kernel": SHORT_CONV_SIZE,
            "expand": EXPAND,
            "use_bias": False,
            "use_conv_bias": b,
            "hidden_act": "silu",
            "initializer_range": EMBEDDING_STD,
            "time_step_min": 0.001,
            "time_step_max": 0.1,
            "time_step_floor": 1e-4,
            "time_step_limit": [0.0, float("inf")],
            "rescale_prenorm_residual": False,
            "residual_in_fp32": False,
            "use_cache": True,
            "n_groups": 1,
            "num_heads": args.n_heads,
            "head_dim": args.head_dim,
            "rms_norm": True,
            "chunk_size": args.chunk_size,
            "intermediate_size": args.hidden_dim,
            "mlp_type": "mlp10",
            "noconv1d": not b,
        }
