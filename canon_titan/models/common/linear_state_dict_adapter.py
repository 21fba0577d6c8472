"""Hugging Face format of the linear models: the release's names (``GLACanon``,
``GatedDeltaNetCanon``, ``Mamba2Canon``), relative to a layer. A family names its backbone, final
norm and block modules; mixer tensors keep their names under the release's mixer module, Canon A
and C keep theirs, and the SwiGLU's ``w1``/``w3`` are the release's fused [gate | up] projection."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from canon_titan.hf import HFModel
from canon_titan.models.common.state_dict_adapter import LAYER, CanonStateDictAdapter, HFTensor

LINEAR_SHARED = ("linear_canon_layers",)
"""The module our linear-model classes share (shipped with each export)."""
LOW_RANK = {
    "mixer.gk_proj.down": "attn.gk_proj.0",
    "mixer.gk_proj.up": "attn.gk_proj.1",
    "mixer.g_proj.down": "attn.g_proj.0",
    "mixer.g_proj.up": "attn.g_proj.1",
}
"""The rank-16 projections: the release's two-layer ``nn.Sequential``."""


class LinearStateDictAdapter(CanonStateDictAdapter):
    classes: ClassVar[HFModel]
    backbone: ClassVar[str] = "model"
    final_norm: ClassVar[str] = "norm"
    block_names: ClassVar[dict[str, str]]
    """canon-titan module (relative to a layer) -> the release's."""

    @property
    def hf_model(self) -> HFModel:
        return self.classes

    def fused_mlp(self) -> str | None:
        """The release's [gate | up] projection, or None for separate gate_proj/up_proj."""
        return "both_proj"

    def names(self) -> dict[str, str]:
        return {
            **self.block_names,
            "feed_forward.w2": "mlp.down_proj",
            "feed_forward.canonD": "mlp.canonD",
        }

    def layout(self, names: Iterable[str]) -> dict[str, HFTensor]:
        renames, fused, prefix = self.names(), self.fused_mlp(), self.backbone
        top = {
            "tok_embeddings.weight": f"{prefix}.embeddings.weight",
            "norm.weight": f"{prefix}.{self.final_norm}.weight",
            "lm_head.weight": "lm_head.weight",
        }
        layout = {}
        for name in names:
            if name in top:
                layout[top[name]] = HFTensor((name,))
                continue
            match = LAYER.match(name)
            if match is None:
                raise KeyError(f"no Hugging Face name for tensor {name!r}")
            layer, leaf = match.groups()
            hf = f"{prefix}.layers.{layer}."
            if leaf in ("feed_forward.w1.weight", "feed_forward.w3.weight"):
                if fused is None:
                    layout[
                        hf + ("mlp.gate_proj.weight" if "w1" in leaf else "mlp.up_proj.weight")
                    ] = HFTensor((name,))
                elif "w1" in leaf:
                    layout[hf + f"mlp.{fused}.weight"] = HFTensor(
                        (name, f"layers.{layer}.feed_forward.w3.weight")
                    )
                continue
            module, param = leaf.rsplit(".", 1)
            if module in renames:
                layout[hf + f"{renames[module]}.{param}"] = HFTensor((name,))
            elif module.startswith("mixer."):
                layout[hf + renames["mixer"] + leaf[len("mixer") :]] = HFTensor((name,))
            elif module in ("canonA", "canonC"):
                layout[hf + leaf] = HFTensor((name,))
            else:
                raise KeyError(f"no Hugging Face name for tensor {name!r}")
        return layout
