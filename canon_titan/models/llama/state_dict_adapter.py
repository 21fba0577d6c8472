"""Hugging Face format of ``llama`` and ``llama_canon``.

A Llama without Canon layers, QK-norm or partial RoPE is transformers' own ``LlamaForCausalLM``;
any other is the release's ``LlamaCanon`` (our classes in ``canon_titan.hf``, shipped beside the
weights). canon-titan follows Lingua's names, so the mapping is the release's renaming.

RoPE: canon-titan rotates interleaved pairs (2i, 2i+1) of the first ``rope_dim`` channels of a
head; Hugging Face's Llama rotate-half pairs (i, i + rope_dim/2). A ``LlamaForCausalLM`` export, or
a LlamaCanon one with ``rope_version = "huggingface"``, reorders those channels in every tensor
indexed by q/k channels: the q/k projection rows, the flat QK-norm weights, and Canon-B's q and k
segments. LlamaCanon's default (``"lingua"``, the release's) keeps them as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from canon_titan.hf import HFModel
from canon_titan.models.common.state_dict_adapter import (
    LAYER,
    CanonStateDictAdapter,
    HFFormatError,
    HFTensor,
)

LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention.canonB.weight": "self_attn.canonB.weight",
    "attention.canonB.bias": "self_attn.canonB.bias",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.canonD.weight": "mlp.canonD.weight",
    "feed_forward.canonD.bias": "mlp.canonD.bias",
    "canonA.weight": "canonA.weight",
    "canonA.bias": "canonA.bias",
    "canonC.weight": "canonC.weight",
    "canonC.bias": "canonC.bias",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LLAMA_CANON = HFModel(
    "configuration_llama_canon.LlamaCanonConfig", "modeling_llama_canon.LlamaCanonForCausalLM"
)
ROPE_LAYOUTS = ("lingua", "huggingface")


def rotate_half_order(head_dim: int, rope_dim: int) -> torch.Tensor:
    """Channel order of one head in the rotate-half layout, as indices into the interleaved one."""
    rotated = list(range(0, rope_dim, 2)) + list(range(1, rope_dim, 2))
    return torch.tensor(rotated + list(range(rope_dim, head_dim)))


def _per_head(order: torch.Tensor, n_heads: int) -> torch.Tensor:
    head_dim = order.numel()
    return torch.cat([order + h * head_dim for h in range(n_heads)])


def hf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = LAYER.match(name)
    if match and match.group(2) in LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"
    raise KeyError(f"no Hugging Face name for tensor {name!r}")


class LlamaStateDictAdapter(CanonStateDictAdapter):
    def __init__(
        self, model_config, hf_assets_path: str | None = None, *, rope_layout: str = "lingua"
    ):
        super().__init__(model_config, hf_assets_path, rope_layout=rope_layout)
        if rope_layout not in ROPE_LAYOUTS:
            raise ValueError(
                f"rope layout must be one of {', '.join(ROPE_LAYOUTS)}, got {rope_layout!r}"
            )
        self.rotate_half = self.hf_model is None or rope_layout == "huggingface"
        """Whether the Hugging Face tensors hold q/k channels in the rotate-half layout."""

    @property
    def plain(self) -> bool:
        """transformers' own Llama computes this model."""
        args = self.args
        return (
            not getattr(args, "canon_set", "")
            and not args.qk_norm
            and (args.rope_dim is None or args.rope_dim == args.head_dim)
        )

    @property
    def hf_model(self) -> HFModel | None:
        return None if self.plain else LLAMA_CANON

    def _orders(self) -> dict[str, torch.Tensor]:
        """Rotate-half row orders of the tensors indexed by q/k channels, by layer-relative name."""
        args = self.args
        order = rotate_half_order(args.head_dim, args.rope_dim or args.head_dim)
        q, k = _per_head(order, args.n_heads), _per_head(order, args.kv_heads)
        n_q, n_kv = q.numel(), k.numel()
        qkv = torch.cat([q, k + n_q, torch.arange(n_kv) + n_q + n_kv])
        return {
            "attention.wq.weight": q,
            "attention.q_norm.weight": q,
            "attention.wk.weight": k,
            "attention.k_norm.weight": k,
            "attention.canonB.weight": qkv,
            "attention.canonB.bias": qkv,
        }

    def layout(self, names: Iterable[str]) -> dict[str, HFTensor]:
        orders = self._orders() if self.rotate_half else {}
        layout = {}
        for name in names:
            match = LAYER.match(name)
            layout[hf_name(name)] = HFTensor(
                (name,), order=orders.get(match.group(2)) if match else None
            )
        return layout

    def hf_fields(self) -> dict:
        args = self.args
        shape = {
            "hidden_size": args.dim,
            "intermediate_size": args.hidden_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "rms_norm_eps": args.norm_eps,
            "hidden_act": "silu",
        }
        if self.plain:
            # transformers 5 reads rope_parameters; 4.x (the release's 4.47) reads the top-level
            # rope_theta and would silently take 10000 without it.
            return {
                **shape,
                "attention_bias": False,
                "mlp_bias": False,
                "rope_theta": args.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
            }
        rope_dim = args.rope_dim or args.head_dim
        return {
            **shape,
            "rope_theta": args.rope_theta,
            "rope_dim": rope_dim,
            "partial_rotary_factor": rope_dim / args.head_dim,
            "rope_version": self.rope_layout,
            "qk_norm": args.qk_norm,
        }

    def config_class(self, hf: dict, where: str):
        model_type = hf.get("model_type")
        if model_type == "llama":
            if not self.plain:
                raise HFFormatError(
                    f"{where}: a plain Llama checkpoint cannot fill a model with Canon layers, "
                    "QK-norm or partial RoPE"
                )
            from transformers import LlamaConfig

            return LlamaConfig
        if model_type == "LlamaCanon":
            return LLAMA_CANON.classes()[0]
        raise HFFormatError(f"{where}: model_type {model_type!r} is not 'llama' or 'LlamaCanon'")

    def compared(self, config_cls) -> list[str]:
        # Compared resolved: LlamaConfig keeps rope_theta in rope_parameters (transformers 5), and
        # LlamaCanon reads a null rope_dim as the whole head.
        return ["rope_theta", "head_dim"] + (
            ["rope_dim"] if config_cls.model_type == "LlamaCanon" else []
        )

    def field(self, config, key: str):
        if key == "rope_theta":
            parameters = getattr(config, "rope_parameters", None) or {}
            return parameters.get("rope_theta", getattr(config, "rope_theta", None))
        return getattr(config, key, None)

    def read_format(self, hf: dict, where: str) -> None:
        # transformers 5 writes rope_parameters, 4.x rope_scaling (absent: plain RoPE).
        rope_type = (hf.get("rope_parameters") or hf.get("rope_scaling") or {}).get(
            "rope_type", "default"
        )
        if rope_type != "default":
            raise HFFormatError(
                f"{where}: rope_parameters has rope_type {rope_type!r}; canon-titan's "
                "models use plain "
                "RoPE ('default')"
            )
        self.rotate_half = (
            hf.get("model_type") == "llama" or hf.get("rope_version") == "huggingface"
        )
