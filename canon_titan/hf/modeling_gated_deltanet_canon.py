"""GatedDeltaNetCanon for transformers 5.x: GDN2, the gated DeltaNet of PhysicsLM4 Part 4.2, with
Canon layers. Tensor names follow the release (``model.embeddings``,
``model.layers.{i}.attn.q_proj``, ``attn.b_proj``, ``attn.a_proj``, ``attn.A_log``,
``attn.dt_bias``, ``attn.q_conv1d``, ``attn.g_proj.0/1``, ``attn.o_norm``, ``mlp.both_proj`` = [gate
| up] with Canon-D, else ``mlp.gate_proj``/``mlp.up_proj``, ``mlp.canonD``, ``model.norm``,
``lm_head``).

    q, k, v = SiLU(conv_b(W x)) with b, else SiLU(W x);  q, k L2-normalised per head
    beta = sigmoid(b_proj(x));  log_decay = -exp(A_log) * softplus(a_proj(x) + dt_bias)   per head
    S_t = (I - beta_t k_t k_t^T) exp(log_decay_t) S_{t-1} + beta_t k_t v_t^T,  o_t = q_t S_t /
        sqrt(head_dim)
    out = o_proj(RMSNorm_head(o) * w * SiLU(g_proj(x)))

The recurrence runs by chunks in plain PyTorch (``chunk_gated_delta_rule``), from a cached state
when decoding.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from .configuration_gated_deltanet_canon import GatedDeltaNetCanonConfig
from .linear_canon_layers import (
    GatedRMSNorm,
    LinearCanonCausalLM,
    RMSNorm,
    SwiGLU,
    canon,
    causal_decay,
    init_gla_style,
    l2norm,
    low_rank,
    residual_block,
    run_layers,
    short_conv,
    upcast,
)


def chunk_gated_delta_rule(q, k, v, log_decay, beta, state=None, chunk_size=64):
    """o [B, T, H, V] (q's dtype) and the final state [B, H, K, V] (float32) of the gated delta rule
    ``S'_t = exp(g_t) S_{t-1}, u_t = beta_t (v_t - S'_t^T k_t), S_t = S'_t + k_t u_t^T, o_t = q_t
    S_t / sqrt(K)``; q, k: [B, T, H, K] (L2-normalised), v: [B, T, H, V], g and beta: [B, T, H].

    Per chunk, with b the cumulative log decay from the chunk start and S0 the entering state,
    the corrections solve the unit lower-triangular system
    ``u_i + beta_i sum_{j<i} exp(b_i - b_j) (k_i . k_j) u_j = beta_i (v_i - exp(b_i) S0^T k_i)``.
    """
    out_dtype, dtype = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (
        t.transpose(1, 2).to(dtype) for t in (q, k, v, log_decay, beta)
    )  # [B, H, T, *]
    q = q * q.shape[-1] ** -0.5
    if state is None:
        state = q.new_zeros(*q.shape[:2], k.shape[-1], v.shape[-1])
    state = state.to(dtype)
    outputs = []
    for start in range(0, q.shape[2], chunk_size):
        qc, kc, vc, gc, bc = (t[:, :, start : start + chunk_size] for t in (q, k, v, g, beta))
        b = gc.cumsum(-1)
        decay = causal_decay(b)  # [B, H, i, j]
        strictly_lower = (bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        rhs = bc.unsqueeze(-1) * (vc - (kc * b.exp().unsqueeze(-1)) @ state)
        # unitriangular: the zero diagonal of strictly_lower is read as ones.
        u = torch.linalg.solve_triangular(strictly_lower, rhs, upper=False, unitriangular=True)
        outputs.append(
            (qc * b.exp().unsqueeze(-1)) @ state + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        )
        last = b[..., -1:]
        state = (
            last.exp().unsqueeze(-1) * state
            + (kc * (last - b).exp().unsqueeze(-1)).transpose(-1, -2) @ u
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).to(out_dtype), state


class GatedDeltaNetCanon(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        d, heads = config.hidden_size, config.num_heads
        self.head_dim, self.head_v_dim = config.head_dim, int(config.head_dim * config.expand_v)
        key_dim, value_dim = heads * self.head_dim, heads * self.head_v_dim
        self.q_proj = nn.Linear(d, key_dim, bias=False)
        self.k_proj = nn.Linear(d, key_dim, bias=False)
        self.v_proj = nn.Linear(d, value_dim, bias=False)
        self.b_proj = nn.Linear(d, heads, bias=False)
        self.a_proj = nn.Linear(d, heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.dt_bias = nn.Parameter(torch.zeros(heads))
        self.use_short_conv = config.use_short_conv
        if self.use_short_conv:
            self.q_conv1d = short_conv(key_dim, config.conv_size)
            self.k_conv1d = short_conv(key_dim, config.conv_size)
            self.v_conv1d = short_conv(value_dim, config.conv_size)
        if config.output_gate_rank is not None:
            self.g_proj = low_rank(d, config.output_gate_rank, value_dim)
        else:
            self.g_proj = nn.Linear(d, value_dim, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v_dim, config.norm_eps, norm_before_gate=True)
        self.o_proj = nn.Linear(value_dim, d, bias=False)

    @torch.no_grad()
    def reset_decay(self):
        """A = U(0, 16); dt_bias = softplus^-1(dt), dt log-uniform in [0.001, 0.1] floored at
        1e-4."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).log())
        dt = (
            torch.empty_like(self.dt_bias)
            .uniform_(math.log(0.001), math.log(0.1))
            .exp()
            .clamp(min=1e-4)
        )
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x, cache, mask):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_short_conv:
            q = self.q_conv1d(q, cache, (self.layer_idx, "q_conv1d"), mask)
            k = self.k_conv1d(k, cache, (self.layer_idx, "k_conv1d"), mask)
            v = self.v_conv1d(v, cache, (self.layer_idx, "v_conv1d"), mask)
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q, k = (l2norm(t.unflatten(-1, (-1, self.head_dim))) for t in (q, k))
        v = v.unflatten(-1, (-1, self.head_v_dim))
        beta = self.b_proj(x).sigmoid()
        log_decay = -upcast(self.A_log).exp() * F.softplus(
            upcast(self.a_proj(x)) + upcast(self.dt_bias)
        )
        if mask is not None:  # padded positions neither decay nor write the state
            keep = mask[:, -x.shape[1] :, None]
            beta, log_decay = beta * keep.to(beta.dtype), log_decay * keep.to(log_decay.dtype)
        state = cache.recurrent_states.get(self.layer_idx) if cache is not None else None
        o, state = chunk_gated_delta_rule(q, k, v, log_decay, beta, state)
        if cache is not None:
            cache.recurrent_states[self.layer_idx] = state.detach()
        gate = self.g_proj(x).unflatten(-1, (-1, self.head_v_dim))
        return self.o_proj(self.o_norm(o, gate).flatten(-2))


class GatedDeltaNetCanonBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.canonA = canon(config, "A", config.hidden_size)
        self.attn = GatedDeltaNetCanon(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.canonC = canon(config, "C", config.hidden_size)
        # The release fuses [gate | up] into one projection only when Canon-D reads it.
        fused = "both_proj" if "D" in config.canon_set else None
        self.mlp = SwiGLU(
            config, config.hidden_size, config.intermediate_size, layer_idx, fused=fused
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


class GatedDeltaNetCanonPreTrainedModel(PreTrainedModel):
    config_class = GatedDeltaNetCanonConfig
    base_model_prefix = "model"
    _input_embed_layer = "embeddings"
    _no_split_modules = ["GatedDeltaNetCanonBlock"]
    _skip_keys_device_placement = ["past_key_values"]

    def _init_weights(self, module):
        init_gla_style(module, self.config.initializer_range)
        if isinstance(module, GatedDeltaNetCanon):
            module.reset_decay()


class GatedDeltaNetCanonModel(GatedDeltaNetCanonPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            GatedDeltaNetCanonBlock(config, i) for i in range(config.num_hidden_layers)
        )
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


class GatedDeltaNetCanonForCausalLM(
    LinearCanonCausalLM, GatedDeltaNetCanonPreTrainedModel, GenerationMixin
):
    def __init__(self, config):
        super().__init__(config)
        self.model = GatedDeltaNetCanonModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
