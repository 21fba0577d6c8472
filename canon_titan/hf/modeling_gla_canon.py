"""GLACanon for transformers 5.x: GLA5, the gated linear attention of PhysicsLM4 Part 4.2, with
Canon layers. Tensor names follow the release (``model.embeddings``,
``model.layers.{i}.attn.q_proj``, ``attn.gk_proj.0/1``, ``attn.g_proj.0/1``, ``attn.q_conv1d``,
``attn.g_norm_swish_gate``, ``mlp.gate_proj`` = [gate | up], ``mlp.canonD``, ``model.norm``,
``lm_head``).

    q, k, v = SiLU(conv_b(W x)) with b, else SiLU(W x)
    log_gate = logsigmoid(gk_proj(x)) / 16                         per key channel
    S_t = diag(exp(log_gate_t)) S_{t-1} + k_t^T v_t,   o_t = q_t S_t / sqrt(head_k_dim)
    out = o_proj(RMSNorm_head(o) * w * SiLU(g_proj(x)))

The recurrence runs by chunks in plain PyTorch (``chunk_gla``), from a cached state when decoding.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from .configuration_gla_canon import GLACanonConfig
from .linear_canon_layers import (
    GatedRMSNorm,
    LinearCanonCausalLM,
    RMSNorm,
    SwiGLU,
    canon,
    init_gla_style,
    low_rank,
    residual_block,
    run_layers,
    short_conv,
    upcast,
)

GATE_LOW_RANK_DIM = 16
GATE_LOGIT_NORMALIZER = 16


def chunk_gla(q, k, v, log_gate, state=None, chunk_size=16):
    """o [B, T, H, V] (q's dtype) and the final state [B, H, K, V] (float32) of
    ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t, o_t = q_t S_t / sqrt(K)``; q, k, g: [B, T, H, K].

    Within a chunk, pair (i, j <= i) decays by exp(b_i - b_j) with b the cumulative log gate from
    the chunk start; only such differences (<= 0) are exponentiated, so strong gates cannot
    overflow. The [chunk, chunk, K] pairwise decays dominate the cost: 16-token chunks (as fla's
    sub-chunks) were 3-5x faster than 32 or 64 on CPU.
    """
    out_dtype, dtype = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v, g = (t.transpose(1, 2).to(dtype) for t in (q, k, v, log_gate))  # [B, H, T, *]
    q = q * q.shape[-1] ** -0.5
    if state is None:
        state = q.new_zeros(*q.shape[:2], k.shape[-1], v.shape[-1])
    state = state.to(dtype)
    outputs = []
    for start in range(0, q.shape[2], chunk_size):
        qc, kc, vc, gc = (t[:, :, start : start + chunk_size] for t in (q, k, v, g))
        b = gc.cumsum(2)
        n = b.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril().unsqueeze(-1)
        pair_decay = (
            (b.unsqueeze(3) - b.unsqueeze(2)).masked_fill(~causal, float("-inf")).exp()
        )  # [B, H, i, j, K]
        scores = (qc.unsqueeze(3) * kc.unsqueeze(2) * pair_decay).sum(-1)
        outputs.append((qc * b.exp()) @ state + scores @ vc)
        last = b[:, :, -1:]
        state = (
            last.transpose(-1, -2).exp() * state + (kc * (last - b).exp()).transpose(-1, -2) @ vc
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).to(out_dtype), state


class GatedCanonLinearAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        d = config.hidden_size
        key_dim, value_dim = int(d * config.expand_k), int(d * config.expand_v)
        self.head_k_dim, self.head_v_dim = (
            key_dim // config.num_heads,
            value_dim // config.num_heads,
        )
        self.clamp_min = config.clamp_min
        self.q_proj = nn.Linear(d, key_dim, bias=False)
        self.k_proj = nn.Linear(d, key_dim, bias=False)
        self.v_proj = nn.Linear(d, value_dim, bias=False)
        if config.output_gate_rank is not None:
            self.g_proj = low_rank(d, config.output_gate_rank, value_dim)
        else:
            self.g_proj = nn.Linear(d, value_dim, bias=False)
        self.use_short_conv = config.use_short_conv
        if self.use_short_conv:
            self.q_conv1d = short_conv(key_dim, config.conv_size)
            self.k_conv1d = short_conv(key_dim, config.conv_size)
            self.v_conv1d = short_conv(value_dim, config.conv_size)
        self.gk_proj = low_rank(d, GATE_LOW_RANK_DIM, key_dim)
        self.o_proj = nn.Linear(value_dim, d, bias=False)
        gate_norm = GatedRMSNorm(self.head_v_dim, config.norm_eps, norm_before_gate=True)
        # The release's two implementations of the same gated norm differ only in name.
        self.norm_name = "g_norm" if config.zeyuan_layernorm else "g_norm_swish_gate"
        self.add_module(self.norm_name, gate_norm)

    def forward(self, x, cache, mask):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_short_conv:
            q = self.q_conv1d(q, cache, (self.layer_idx, "q_conv1d"), mask)
            k = self.k_conv1d(k, cache, (self.layer_idx, "k_conv1d"), mask)
            v = self.v_conv1d(v, cache, (self.layer_idx, "v_conv1d"), mask)
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        log_gate = F.logsigmoid(upcast(self.gk_proj(x))) / GATE_LOGIT_NORMALIZER
        if self.clamp_min is not None:
            log_gate = log_gate.clamp_min(self.clamp_min)
        if mask is not None:  # padded positions add nothing to the state
            v = v * mask[:, -v.shape[1] :, None].to(v.dtype)
        q, k, log_gate = (t.unflatten(-1, (-1, self.head_k_dim)) for t in (q, k, log_gate))
        v = v.unflatten(-1, (-1, self.head_v_dim))
        state = cache.recurrent_states.get(self.layer_idx) if cache is not None else None
        o, state = chunk_gla(q, k, v, log_gate, state)
        if cache is not None:
            cache.recurrent_states[self.layer_idx] = state.detach()
        gate = self.g_proj(x).unflatten(-1, (-1, self.head_v_dim))
        return self.o_proj(getattr(self, self.norm_name)(o, gate).flatten(-2))


class GLABlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.canonA = canon(config, "A", config.hidden_size)
        self.attn = GatedCanonLinearAttention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.canonC = canon(config, "C", config.hidden_size)
        self.mlp = SwiGLU(
            config, config.hidden_size, config.intermediate_size, layer_idx, fused="gate_proj"
        )

    def forward(self, x, cache, mask):
        return residual_block(
            x,
            cache,
            mask,
            self.layer_idx,
            self.attn_norm,
            self.canonA,
            self.attn,
            self.mlp_norm,
            self.canonC,
            self.mlp,
        )


class GLACanonPreTrainedModel(PreTrainedModel):
    config_class = GLACanonConfig
    base_model_prefix = "model"
    _input_embed_layer = "embeddings"
    _no_split_modules = ["GLABlock"]
    _skip_keys_device_placement = ["past_key_values"]

    def _init_weights(self, module):
        init_gla_style(module, self.config.initializer_range)


class GLACanonModel(GLACanonPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(GLABlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        **kwargs,
    ):
        h, cache = run_layers(
            self, input_ids, inputs_embeds, attention_mask, past_key_values, use_cache
        )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), past_key_values=cache)


class GLACanonForCausalLM(LinearCanonCausalLM, GLACanonPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = GLACanonModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
