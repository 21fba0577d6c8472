"""Parameter names and layouts: canon-titan (TorchTitan FQNs) <-> Hugging Face.

``hf_layout`` lists every tensor of the Hugging Face model and the canon-titan tensors it is made
of: usually one renamed tensor; for the linear models' fused SwiGLU projection the release's
[gate | up] ``gate_proj``/``both_proj`` stacks ``w1`` and ``w3``; and a Mamba2 without b carries the
release's frozen identity convolution, which canon-titan does not have.

canon-titan follows Lingua's names, so the LlamaCanon mapping is the release's renaming. RoPE:
canon-titan rotates interleaved pairs (2i, 2i+1) of the first ``rope_dim`` channels of a head;
Hugging Face's rotate-half pairs (i, i + rope_dim/2). Exporting with the 'huggingface' layout
(and always for plain ``LlamaForCausalLM``) reorders those channels in every tensor indexed by
q/k channels: the q/k projection rows, the flat QK-norm weights, and Canon-B's q and k segments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from canon_titan.models.linear import SHORT_CONV_SIZE

_LAYER_MAP = {
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
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def to_hf_name(fqn: str) -> str:
    if fqn in _TOP_MAP:
        return _TOP_MAP[fqn]
    match = _LAYER_RE.match(fqn)
    if match and match.group(2) in _LAYER_MAP:
        return f"model.layers.{match.group(1)}.{_LAYER_MAP[match.group(2)]}"
    raise KeyError(f"no Hugging Face name for tensor {fqn!r}")


def rotate_half_order(head_dim: int, rope_dim: int) -> torch.Tensor:
    """Channel order of one head in the rotate-half layout, as indices into the interleaved one."""
    rotated = list(range(0, rope_dim, 2)) + list(range(1, rope_dim, 2))
    return torch.tensor(rotated + list(range(rope_dim, head_dim)))


def _per_head(order: torch.Tensor, n_heads: int) -> torch.Tensor:
    head_dim = order.numel()
    return torch.cat([order + h * head_dim for h in range(n_heads)])


def qk_channel_orders(args) -> dict[str, torch.Tensor]:
    """Permutations (new index -> old index) along the q and k channel axes."""
    order = rotate_half_order(args.head_dim, args.rope_dim or args.head_dim)
    return {"q": _per_head(order, args.n_heads), "k": _per_head(order, args.kv_heads)}


def relayout(fqn: str, tensor: torch.Tensor, args, to_rotate_half: bool) -> torch.Tensor:
    """Reorder q/k channels between the interleaved and rotate-half layouts (either way)."""
    orders = qk_channel_orders(args)
    if not to_rotate_half:
        orders = {k: torch.argsort(v) for k, v in orders.items()}
    leaf = _LAYER_RE.match(fqn).group(2) if _LAYER_RE.match(fqn) else fqn
    if leaf in ("attention.wq.weight", "attention.q_norm.weight"):
        return tensor[orders["q"]]
    if leaf in ("attention.wk.weight", "attention.k_norm.weight"):
        return tensor[orders["k"]]
    if leaf in ("attention.canonB.weight", "attention.canonB.bias"):
        n_q, n_kv = orders["q"].numel(), orders["k"].numel()
        full = torch.cat([orders["q"], orders["k"] + n_q, torch.arange(n_kv) + n_q + n_kv])
        return tensor[full]
    return tensor


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the Hugging Face model."""

    sources: tuple[str, ...] = ()
    """The canon-titan tensors it is made of, stacked along dim 0 in this order."""
    fixed: torch.Tensor | None = None
    """Or a value written as is and ignored on import (it has no canon-titan counterpart)."""


def hf_layout(args, names, *, gla_plain_gate_norm: bool = False) -> dict[str, HFTensor]:
    """Every tensor of the Hugging Face model of ``args`` whose canon-titan tensors are ``names``.
    ``gla_plain_gate_norm``: name GLA5's gated norm ``attn.g_norm`` (a release model trained with
    ``zeyuan_layernorm``) instead of ``attn.g_norm_swish_gate``."""
    family = getattr(args, "family", None)
    if family is None:
        return {to_hf_name(name): HFTensor((name,)) for name in names}
    return _linear_layout(args, list(names), gla_plain_gate_norm)


def hf_shapes(layout: dict[str, HFTensor], shapes: dict[str, torch.Size]) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor, from the canon-titan shapes."""
    found = {}
    for hf_name, spec in layout.items():
        if spec.fixed is not None:
            found[hf_name] = tuple(spec.fixed.shape)
        else:
            rows = sum(shapes[s][0] for s in spec.sources)
            found[hf_name] = (rows, *shapes[spec.sources[0]][1:])
    return found


def titan_rows(layout: dict[str, HFTensor], shapes: dict[str, torch.Size]) -> dict[str, tuple[str, int, int]]:
    """Where every canon-titan tensor lies: (Hugging Face tensor, first row, end row)."""
    found = {}
    for hf_name, spec in layout.items():
        row = 0
        for source in spec.sources:
            found[source] = (hf_name, row, row + shapes[source][0])
            row += shapes[source][0]
    return found


# The release's names of the linear models, relative to a layer: canon-titan module -> release
# module. Other mixer tensors keep their names under the release's mixer; Canon A and C keep theirs.
_LINEAR_MLP = {"feed_forward.w2": "mlp.down_proj", "feed_forward.canonD": "mlp.canonD"}
_LOW_RANK = {"mixer.gk_proj.down": "attn.gk_proj.0", "mixer.gk_proj.up": "attn.gk_proj.1",
             "mixer.g_proj.down": "attn.g_proj.0", "mixer.g_proj.up": "attn.g_proj.1"}
_LINEAR_BLOCK = {
    "GLA5": {"mixer": "attn", "mixer_norm": "attn_norm", "ffn_norm": "mlp_norm",
             "mixer.g_norm": "attn.g_norm_swish_gate", **_LOW_RANK},
    "GDN2": {"mixer": "attn", "mixer_norm": "attn_norm", "ffn_norm": "mlp_norm", **_LOW_RANK},
    "Mamba2": {"mixer": "mixer", "mixer_norm": "norm", "ffn_norm": "pre_mlp_layernorm"},
}
# (backbone prefix, final norm) of the release's classes.
_LINEAR_BACKBONE = {"GLA5": ("model", "norm"), "GDN2": ("model", "norm"), "Mamba2": ("backbone", "norm_f")}


def fused_mlp_name(family: str, canon_set: str) -> str | None:
    """The release's [gate | up] projection of a linear model, or None for separate gate_proj/up_proj
    (GDN2 fuses them only when Canon-D reads them)."""
    if family == "GDN2" and "D" not in canon_set:
        return None
    return "gate_proj" if family == "GLA5" else "both_proj"


def mamba2_identity_conv(args) -> torch.Tensor:
    """The kernel [0, 0, 0, 1] per x|B|C channel that a Mamba2 without b stores in the release."""
    kernel = torch.zeros(args.n_heads * args.head_dim + 2 * args.state_size, 1, SHORT_CONV_SIZE)
    kernel[:, :, -1] = 1.0
    return kernel


def _linear_layout(args, names: list[str], gla_plain_gate_norm: bool) -> dict[str, HFTensor]:
    family = args.family
    prefix, final_norm = _LINEAR_BACKBONE[family]
    renames = {**_LINEAR_BLOCK[family], **_LINEAR_MLP}
    if gla_plain_gate_norm:
        renames["mixer.g_norm"] = "attn.g_norm"
    top = {"tok_embeddings.weight": f"{prefix}.embeddings.weight", "norm.weight": f"{prefix}.{final_norm}.weight",
           "lm_head.weight": "lm_head.weight"}
    fused = fused_mlp_name(family, args.canon_set)
    layout = {}
    for name in names:
        if name in top:
            layout[top[name]] = HFTensor((name,))
            continue
        match = _LAYER_RE.match(name)
        if match is None:
            raise KeyError(f"no Hugging Face name for tensor {name!r}")
        layer, leaf = match.groups()
        hf = f"{prefix}.layers.{layer}."
        if leaf in ("feed_forward.w1.weight", "feed_forward.w3.weight"):
            if fused is None:
                layout[hf + ("mlp.gate_proj.weight" if "w1" in leaf else "mlp.up_proj.weight")] = HFTensor((name,))
            elif "w1" in leaf:
                layout[hf + f"mlp.{fused}.weight"] = HFTensor((name, f"layers.{layer}.feed_forward.w3.weight"))
            continue
        module, param = leaf.rsplit(".", 1)
        if module in renames:
            layout[hf + f"{renames[module]}.{param}"] = HFTensor((name,))
        elif module.startswith("mixer."):
            layout[hf + renames["mixer"] + leaf[len("mixer"):]] = HFTensor((name,))
        elif module in ("canonA", "canonC"):
            layout[hf + leaf] = HFTensor((name,))
        else:
            raise KeyError(f"no Hugging Face name for tensor {name!r}")
    if family == "Mamba2" and "b" not in args.canon_set:
        for layer in range(args.n_layers):
            layout[f"backbone.layers.{layer}.mixer.conv1d.weight"] = HFTensor(fixed=mamba2_identity_conv(args))
    return layout
