"""Mamba2Canon for transformers 5.x: Mamba2 of PhysicsLM4 Part 4.2 with a SwiGLU MLP per block
("mlp10") and Canon layers. Tensor names follow the release (``backbone.embeddings``,
``backbone.layers.{i}.norm``, ``mixer.in_proj``, ``mixer.conv1d`` (+ bias), ``mixer.dt_bias``,
``mixer.A_log``, ``mixer.D``, ``mixer.norm``, ``mixer.out_proj``, ``pre_mlp_layernorm``,
``mlp.both_proj`` = [gate | up], ``mlp.canonD``, ``backbone.norm_f``, ``lm_head``).

    [z | xBC | dt] = in_proj(x)                      widths d_inner, d_inner + 2 G N, H
    xBC = SiLU(conv1d(xBC)) with b, else unchanged (noconv1d: the release's frozen identity kernel)
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,  y_t = h_t C_t + D x_t
        with dt = softplus(dt + dt_bias), A = -exp(A_log); head h reads group h // (H / G)
    out = out_proj(RMSNorm(y * SiLU(z)) * w)

The scan runs by chunks in plain PyTorch (``chunk_ssd``), from a cached state when decoding.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

from .configuration_mamba2_canon import Mamba2CanonConfig
from .linear_canon_layers import (
    CausalConv,
    GatedRMSNorm,
    LinearCanonCausalLM,
    RMSNorm,
    SwiGLU,
    canon,
    causal_decay,
    residual_block,
    run_layers,
    short_conv,
    upcast,
)


def chunk_ssd(x, dt, A, B, C, D, state=None, chunk_size=256):
    """y [b, T, H, P] (x's dtype) and the final state [b, H, P, N] (float32) of
    ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t``;
    x: [b, T, H, P], dt: [b, T, H] (positive), A, D: [H], B, C: [b, T, G, N]."""
    out_dtype, dtype = x.dtype, torch.promote_types(x.dtype, torch.float32)
    heads, groups = x.shape[2], B.shape[2]
    B, C = (t.repeat_interleave(heads // groups, dim=2) for t in (B, C))
    x, dt, B, C = (t.transpose(1, 2).to(dtype) for t in (x, dt, B, C))  # [b, H, T, *]
    A, D = A.to(dtype), D.to(dtype)
    if state is None:
        state = x.new_zeros(*x.shape[:2], x.shape[-1], B.shape[-1])
    state = state.to(dtype)
    outputs = []
    for start in range(0, x.shape[2], chunk_size):
        xc, dtc, Bc, Cc = (t[:, :, start : start + chunk_size] for t in (x, dt, B, C))
        a = (dtc * A[:, None]).cumsum(-1)  # log decay from the chunk start
        dx = xc * dtc.unsqueeze(-1)
        scores = (Cc @ Bc.transpose(-1, -2)) * causal_decay(a)
        entering = (Cc @ state.transpose(-1, -2)) * a.exp().unsqueeze(-1)
        outputs.append(scores @ dx + entering + D[:, None, None] * xc)
        last = a[..., -1:]
        state = (
            last.exp().unsqueeze(-1) * state
            + (dx * (last - a).exp().unsqueeze(-1)).transpose(-1, -2) @ Bc
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).to(out_dtype), state


class Mamba2CanonMixer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim, self.n_groups = (
            config.num_heads,
            config.head_dim,
            config.n_groups,
        )
        self.state_size, self.chunk_size = config.state_size, config.chunk_size
        self.time_step_limit = tuple(config.time_step_limit)
        self.intermediate_size = config.expand * config.hidden_size
        conv_dim = self.intermediate_size + 2 * self.n_groups * self.state_size
        self.in_proj = nn.Linear(
            config.hidden_size,
            self.intermediate_size + conv_dim + self.num_heads,
            bias=config.use_bias,
        )
        self.noconv1d = config.noconv1d
        self.conv1d = short_conv(conv_dim, config.conv_kernel, bias=config.use_conv_bias)
        if self.noconv1d:
            # Kept (frozen, never applied) so the tensor names match the release, which stores it.
            self.conv1d.weight.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(
            self.intermediate_size, config.layer_norm_epsilon, norm_before_gate=False
        )
        self.out_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.use_bias)

    @torch.no_grad()
    def reset_ssm(self):
        """A = U(1, 16), D = 1, dt_bias = softplus^-1(dt) for dt log-uniform in [0.001, 0.1] floored
        at 1e-4; without b the identity kernel [0, ..., 0, 1]."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        self.D.fill_(1.0)
        dt = (
            torch.empty_like(self.dt_bias)
            .uniform_(math.log(0.001), math.log(0.1))
            .exp()
            .clamp(min=1e-4)
        )
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        if self.noconv1d:
            self.conv1d.weight.zero_()[:, :, -1] = 1.0

    def forward(self, x, cache, mask):
        if mask is not None:
            x = x * mask[:, -x.shape[1] :, None].to(x.dtype)
        n, heads = self.n_groups * self.state_size, self.num_heads
        z, xbc, dt = self.in_proj(x).split(
            [self.intermediate_size, self.intermediate_size + 2 * n, heads], dim=-1
        )
        if not self.noconv1d:
            xbc = self.conv1d(xbc, cache, (self.layer_idx, "conv1d"), mask)
            if mask is not None:
                xbc = xbc * mask[:, -xbc.shape[1] :, None].to(xbc.dtype)
        xs, B, C = xbc.split([self.intermediate_size, n, n], dim=-1)
        dt = F.softplus(upcast(dt) + upcast(self.dt_bias))
        if self.time_step_limit != (0.0, float("inf")):
            dt = dt.clamp(*self.time_step_limit)
        A = -upcast(self.A_log).exp()
        state = cache.recurrent_states.get(self.layer_idx) if cache is not None else None
        y, state = chunk_ssd(
            xs.unflatten(-1, (heads, self.head_dim)),
            dt,
            A,
            B.unflatten(-1, (self.n_groups, -1)),
            C.unflatten(-1, (self.n_groups, -1)),
            self.D,
            state,
            self.chunk_size,
        )
        if cache is not None:
            cache.recurrent_states[self.layer_idx] = state.detach()
        return self.out_proj(self.norm(y.flatten(-2), z))


class Mamba2CanonBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.canonA = canon(config, "A", config.hidden_size)
        self.mixer = Mamba2CanonMixer(config, layer_idx)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.canonC = canon(config, "C", config.hidden_size)
        self.mlp = SwiGLU(
            config, config.hidden_size, config.intermediate_size, layer_idx, fused="both_proj"
        )

    def forward(self, x, cache, mask):
        return residual_block(
            x,
            cache,
            mask,
            self.layer_idx,
            self.norm,
            self.canonA,
            self.mixer,
            self.pre_mlp_layernorm,
            self.canonC,
            self.mlp,
        )


class Mamba2CanonPreTrainedModel(PreTrainedModel):
    config_class = Mamba2CanonConfig
    base_model_prefix = "backbone"
    _input_embed_layer = "embeddings"
    _no_split_modules = ["Mamba2CanonBlock"]
    _skip_keys_device_placement = ["past_key_values"]

    @torch.no_grad()
    def _init_weights(self, module):
        """The release's init: linears and convolutions PyTorch's default (linear biases zero),
        embeddings N(0, initializer_range), norms one, the SSM parameters as ``reset_ssm``."""
        if isinstance(module, nn.Linear):
            module.reset_parameters()
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, self.config.initializer_range)
        elif isinstance(module, (RMSNorm, GatedRMSNorm)):
            nn.init.ones_(module.weight)
        elif isinstance(module, CausalConv):
            module.reset_parameters()
        elif isinstance(module, Mamba2CanonMixer):
            module.reset_ssm()


class Mamba2CanonModel(Mamba2CanonPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            Mamba2CanonBlock(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
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
        return BaseModelOutputWithPast(last_hidden_state=self.norm_f(h), past_key_values=cache)


class Mamba2CanonForCausalLM(LinearCanonCausalLM, Mamba2CanonPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.backbone = Mamba2CanonModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
