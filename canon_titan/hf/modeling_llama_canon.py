"""LlamaCanon for transformers 5.x: Llama with Canon layers (PhysicsLM4 Part 4.1), partial RoPE
and flat QK-norm. Tensor names follow the release (``model.layers.{i}.canonA.weight``,
``self_attn.canonB``, ``mlp.canonD``, ``self_attn.q_norm``, ...).

Generation keeps a key/value cache and, per Canon layer, the last ``K-1`` inputs of the
convolution, stored on the cache object (``cache.canon_states``), so decoding one token at a time
gives the same result as re-running the whole sequence.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_llama_canon import LlamaCanonConfig


class LlamaCanonRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).type_as(x)


class LlamaCanonConv(nn.Module):
    """Causal depthwise conv over the sequence (weight [C, 1, K], index K-1 = current token)."""

    def __init__(self, channels, config):
        super().__init__()
        self.kernel_size = config.canon_kernel
        self.residual, self.activation = config.canon_residual, config.canon_activation
        self.weight = nn.Parameter(torch.empty(channels, 1, self.kernel_size))
        self.bias = nn.Parameter(torch.empty(channels)) if config.canon_bias else None

    def reset_parameters(self):
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.kernel_size)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x, cache=None, key=None, mask=None):
        """x: [batch, seq, channels]; ``cache`` (with ``key``) holds the previous K-1 inputs."""
        if mask is not None:
            x = x * mask[:, -x.shape[1] :, None].to(x.dtype)
        k, seq_len = self.kernel_size, x.shape[1]
        states = getattr(cache, "canon_states", None) if cache is not None else None
        previous = states.get(key) if states is not None else None
        if previous is None:
            previous = x.new_zeros(x.shape[0], k - 1, x.shape[2])
        window = torch.cat([previous, x], dim=1)
        if cache is not None:
            if states is None:
                states = cache.canon_states = {}
            states[key] = window[:, -(k - 1) :].detach()
        weight = self.weight.squeeze(1)
        y = window[:, k - 1 :] * weight[:, k - 1]
        for j in range(k - 1):
            y = y + window[:, j : j + seq_len] * weight[:, j]
        if self.bias is not None:
            y = y + self.bias
        if self.activation:
            y = F.silu(y)
        return x + y if self.residual else y


def _canon(config, letter, channels):
    return LlamaCanonConv(channels, config) if letter in config.canon_set else None


def apply_partial_rope(x, positions, config):
    """Rotate the first ``rope_dim`` channels of each head of x [batch, seq, heads, head_dim]."""
    rope_dim = config.rope_dim
    inv_freq = 1.0 / (
        config.rope_theta
        ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=x.device) / rope_dim)
    )
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [batch, seq, rope_dim/2]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    rot, keep = x[..., :rope_dim].float(), x[..., rope_dim:]
    if config.rope_version == "lingua":
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    else:
        x0, x1 = rot[..., : rope_dim // 2], rot[..., rope_dim // 2 :]
        rotated = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return torch.cat((rotated.type_as(x), keep), dim=-1)


class LlamaCanonAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        hd, n_q, n_kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(config.hidden_size, n_q * hd, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, n_kv * hd, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, n_kv * hd, bias=False)
        self.o_proj = nn.Linear(n_q * hd, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = LlamaCanonRMSNorm(n_q * hd, config.rms_norm_eps)
            self.k_norm = LlamaCanonRMSNorm(n_kv * hd, config.rms_norm_eps)
        self.canonB = _canon(config, "B", (n_q + 2 * n_kv) * hd)

    def forward(self, x, positions, cache, mask2d):
        batch, seq_len, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.canonB is not None:
            sizes = (q.shape[-1], k.shape[-1], v.shape[-1])
            qkv = self.canonB(torch.cat((q, k, v), dim=-1), cache, (self.layer_idx, "B"), mask2d)
            q, k, v = qkv.split(sizes, dim=-1)
        q = apply_partial_rope(q.view(batch, seq_len, -1, self.head_dim), positions, self.config)
        k = apply_partial_rope(k.view(batch, seq_len, -1, self.head_dim), positions, self.config)
        q, k, v = (
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.view(batch, seq_len, -1, self.head_dim).transpose(1, 2),
        )
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        attn_mask, causal = None, past == 0 and mask2d is None
        if not causal and (seq_len > 1 or mask2d is not None):
            total = k.shape[2]
            query_pos = torch.arange(past, past + seq_len, device=x.device)[:, None]
            key_pos = torch.arange(total, device=x.device)[None, :]
            attn_mask = key_pos <= query_pos
            if mask2d is not None:
                # A padding query keeps its own key, so no row is empty (an empty row gives NaN).
                attn_mask = (attn_mask & mask2d[:, None, None, -total:].bool()) | (
                    key_pos == query_pos
                )
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=causal and seq_len > 1,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return self.o_proj(out.transpose(1, 2).flatten(2))


class LlamaCanonMLP(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.canonD = _canon(config, "D", 2 * config.intermediate_size)

    def forward(self, x, cache, mask2d):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.canonD is not None:
            gate, up = self.canonD(
                torch.cat((gate, up), dim=-1), cache, (self.layer_idx, "D"), mask2d
            ).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaCanonDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = LlamaCanonRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaCanonRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.canonA = _canon(config, "A", config.hidden_size)
        self.canonC = _canon(config, "C", config.hidden_size)
        self.self_attn = LlamaCanonAttention(config, layer_idx)
        self.mlp = LlamaCanonMLP(config, layer_idx)

    def forward(self, h, positions, cache, mask2d):
        a = self.input_layernorm(h)
        if self.canonA is not None:
            a = self.canonA(a, cache, (self.layer_idx, "A"), mask2d)
        h = h + self.self_attn(a, positions, cache, mask2d)
        m = self.post_attention_layernorm(h)
        if self.canonC is not None:
            m = self.canonC(m, cache, (self.layer_idx, "C"), mask2d)
        return h + self.mlp(m, cache, mask2d)


class LlamaCanonPreTrainedModel(PreTrainedModel):
    config_class = LlamaCanonConfig
    base_model_prefix = "model"
    _no_split_modules = ["LlamaCanonDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, LlamaCanonRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, LlamaCanonConv):
            # PyTorch's conv default (std ~0.289 for K=4); 0.02 would cripple Canon layers.
            module.reset_parameters()


class LlamaCanonModel(LlamaCanonPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            LlamaCanonDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = LlamaCanonRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        **kwargs,
    ):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        cache = past_key_values if use_cache else None
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + h.shape[1], device=h.device)[None].expand(
                h.shape[0], -1
            )
        mask2d = (
            attention_mask
            if attention_mask is not None and not bool(attention_mask.all())
            else None
        )
        for layer in self.layers:
            h = layer(h, position_ids, cache, mask2d)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), past_key_values=cache)


class LlamaCanonForCausalLM(LlamaCanonPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaCanonModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        kwargs.pop("return_dict", None)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)
