"""Parameter names and layouts: canon-titan (TorchTitan FQNs) <-> Hugging Face.

canon-titan follows Lingua's names, so the LlamaCanon mapping is the release's renaming. RoPE:
canon-titan rotates interleaved pairs (2i, 2i+1) of the first ``rope_dim`` channels of a head;
Hugging Face's rotate-half pairs (i, i + rope_dim/2). Exporting with the 'huggingface' layout
(and always for plain ``LlamaForCausalLM``) reorders those channels in every tensor indexed by
q/k channels: the q/k projection rows, the flat QK-norm weights, and Canon-B's q and k segments.
"""

from __future__ import annotations

import re

import torch

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
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_TO_TITAN_LAYER = {v: k for k, v in _LAYER_MAP.items()}
_HF_TO_TITAN_TOP = {v: k for k, v in _TOP_MAP.items()}


def to_hf_name(fqn: str) -> str:
    if fqn in _TOP_MAP:
        return _TOP_MAP[fqn]
    match = _LAYER_RE.match(fqn)
    if match and match.group(2) in _LAYER_MAP:
        return f"model.layers.{match.group(1)}.{_LAYER_MAP[match.group(2)]}"
    raise KeyError(f"no Hugging Face name for tensor {fqn!r}")


def from_hf_name(name: str) -> str:
    if name in _HF_TO_TITAN_TOP:
        return _HF_TO_TITAN_TOP[name]
    match = _HF_LAYER_RE.match(name)
    if match and match.group(2) in _HF_TO_TITAN_LAYER:
        return f"layers.{match.group(1)}.{_HF_TO_TITAN_LAYER[match.group(2)]}"
    raise KeyError(f"unexpected tensor {name!r}: not a Llama/LlamaCanon parameter")


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
