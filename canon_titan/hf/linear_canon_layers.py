"""What the transformers classes of the linear models (GLACanon, GatedDeltaNetCanon, Mamba2Canon)
share: norms, the causal convolutions (Canon layers and the built-in short convolutions "b"), the
decoding cache, the SwiGLU feed-forward and the causal-LM head. Imports only torch and
transformers: ``canon-titan convert to-hf`` ships this file next to the weights.

Decoding: ``LinearCanonCache`` keeps, per layer, the recurrent state of the mixer and the last
``K-1`` inputs of every convolution, so feeding one token at a time gives what re-running the
whole sequence gives. A 2-D 0/1 ``attention_mask`` (left padding) zeroes the inputs of the
convolutions and keeps padded positions out of the recurrent state, as the release does.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast


def upcast(t):
    """float32 for half precision; float64 stays float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim with a SiLU gate, in float32.

    ``norm_before_gate``: ``norm(x) * w * silu(g)`` (fla's FusedRMSNormSwishGate, per head);
    otherwise ``norm(x * silu(g)) * w`` (Mamba2's gated norm over the whole inner width).
    """

    def __init__(self, dim, eps, norm_before_gate):
        super().__init__()
        self.eps, self.norm_before_gate = eps, norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        xf, gate = upcast(x), F.silu(upcast(gate))
        if not self.norm_before_gate:
            xf = xf * gate
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * upcast(self.weight)
        if self.norm_before_gate:
            xf = xf * gate
        return xf.type_as(x)


class CausalConv(nn.Module):
    """Causal depthwise convolution over the sequence, weight [C, 1, K] (index K-1 = current token).

    Canon layers (A, C, D) are residual; the built-in short convolutions (b) are not and apply SiLU.
    """

    def __init__(self, channels, kernel_size, *, residual, activation, bias, builtin=False):
        super().__init__()
        self.kernel_size, self.residual, self.activation = kernel_size, residual, activation
        self.builtin = (
            builtin  # a short convolution b (initialised as the family does), not a Canon layer
        )
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None

    def reset_parameters(self):
        # PyTorch's conv default (std ~0.289 for K=4); 0.02 would cripple Canon layers.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.kernel_size)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x, cache=None, key=None, mask=None):
        """x: [batch, seq, channels]; ``cache`` keeps the previous K-1 inputs under ``key``."""
        if mask is not None:
            x = x * mask[:, -x.shape[1] :, None].to(x.dtype)
        k, seq_len = self.kernel_size, x.shape[1]
        previous = cache.conv_states.get(key) if cache is not None else None
        if previous is None:
            previous = x.new_zeros(x.shape[0], k - 1, x.shape[2])
        window = torch.cat([previous, x], dim=1)
        if cache is not None:
            cache.conv_states[key] = window[:, -(k - 1) :].detach()
        weight = self.weight.squeeze(1)
        y = window[:, k - 1 :] * weight[:, k - 1]
        for j in range(k - 1):
            y = y + window[:, j : j + seq_len] * weight[:, j]
        if self.bias is not None:
            y = y + self.bias
        if self.activation:
            y = F.silu(y)
        return x + y if self.residual else y


def canon(config, letter, channels):
    """The Canon layer at position ``letter`` (A, C or D) of ``config.canon_set``, or None."""
    if letter not in config.canon_set:
        return None
    return CausalConv(
        channels,
        config.canon_kernel,
        residual=config.canon_residual,
        activation=config.canon_activation,
        bias=config.canon_bias,
    )


def short_conv(channels, kernel_size, bias=False):
    """A built-in short convolution (Canon-b): SiLU, no residual."""
    return CausalConv(
        channels, kernel_size, residual=False, activation=True, bias=bias, builtin=True
    )


def low_rank(in_features, rank, out_features):
    """The release's rank-r projection ``nn.Sequential(down, up)``; tensors ``.0`` and ``.1``
    (biased)."""
    projection = nn.Sequential(
        nn.Linear(in_features, rank, bias=False), nn.Linear(rank, out_features, bias=True)
    )
    for factor in projection:
        factor.split_init_rank = rank
    return projection


@torch.no_grad()
def init_gla_style(module, std):
    """The release's ``_init_weights`` of GLA/GDN: N(0, std) linears, embeddings and short
    convolutions (zero biases), both factors of a rank-r projection N(0, sqrt(std) / r^(1/4)) (so
    their product has about the variance of one full matrix), norms one, Canon layers PyTorch's
    default."""
    if isinstance(module, nn.Linear):
        rank = getattr(module, "split_init_rank", None)
        nn.init.normal_(module.weight, 0.0, std**0.5 / rank**0.25 if rank else std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, 0.0, std)
    elif isinstance(module, (RMSNorm, GatedRMSNorm)):
        nn.init.ones_(module.weight)
    elif isinstance(module, CausalConv):
        if module.builtin:
            nn.init.normal_(module.weight, 0.0, std)
        else:
            module.reset_parameters()


def l2norm(x, eps=1e-6):
    xf = upcast(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).type_as(x)


def causal_decay(b):
    """exp(b_i - b_j) for j <= i, else 0, from cumulative log decays b [..., T] -> [..., T, T]."""
    causal = torch.ones(b.shape[-1], b.shape[-1], dtype=torch.bool, device=b.device).tril()
    return (b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()


class SwiGLU(nn.Module):
    """``down_proj(silu(gate) * up)``, Canon-D on [gate | up]; ``fused`` names the [gate | up]
    projection (GLA5: ``gate_proj``, GDN2 with D and Mamba2: ``both_proj``); without it there are
    separate ``gate_proj`` and ``up_proj`` (GDN2 without D)."""

    def __init__(self, config, hidden_size, intermediate_size, layer_idx, fused):
        super().__init__()
        self.layer_idx, self.fused = layer_idx, fused
        if fused is not None:
            self.add_module(fused, nn.Linear(hidden_size, 2 * intermediate_size, bias=False))
        else:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.canonD = canon(config, "D", 2 * intermediate_size)

    def forward(self, x, cache, mask):
        if self.fused is not None:
            gate_up = getattr(self, self.fused)(x)
        else:
            gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        if self.canonD is not None:
            gate_up = self.canonD(gate_up, cache, (self.layer_idx, "D"), mask)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def residual_block(x, cache, mask, layer_idx, mixer_norm, canonA, mixer, mlp_norm, canonC, mlp):
    """The pre-norm block of every family: ``h = x + mixer(CanonA(mixer_norm(x)))``,
    ``out = h + mlp(CanonC(mlp_norm(h)))``."""
    a = mixer_norm(x)
    if canonA is not None:
        a = canonA(a, cache, (layer_idx, "A"), mask)
    h = x + mixer(a, cache, mask)
    m = mlp_norm(h)
    if canonC is not None:
        m = canonC(m, cache, (layer_idx, "C"), mask)
    return h + mlp(m, cache, mask)


class LinearCanonCache:
    """Decoding state: per layer the mixer's recurrent state and the last K-1 inputs of every
    convolution (keys ``(layer, name)``), and the number of tokens seen."""

    is_compileable = False

    def __init__(self):
        self.conv_states = {}
        self.recurrent_states = {}
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx=0):
        return self.seen_tokens

    def reorder_cache(self, beam_idx):
        for states in (self.conv_states, self.recurrent_states):
            for key, state in states.items():
                states[key] = state.index_select(0, beam_idx.to(state.device))


def run_layers(model, input_ids, inputs_embeds, attention_mask, past_key_values, use_cache):
    """Embeddings and blocks of a backbone; returns (hidden states before the final norm, cache)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    h = model.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
    use_cache = model.config.use_cache if use_cache is None else use_cache
    cache = None
    if use_cache:
        cache = past_key_values if past_key_values is not None else LinearCanonCache()
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("attention_mask must be a 2-D 0/1 padding mask [batch, seq]")
    mask = attention_mask if attention_mask is not None and not bool(attention_mask.all()) else None
    for layer in model.layers:
        h = layer(h, cache, mask)
    if cache is not None:
        cache.seen_tokens += h.shape[1]
    return h, cache


class LinearCanonCausalLM:
    """Causal-LM forward and generation support of the linear models, mixed into each family's
    ``...ForCausalLM(LinearCanonCausalLM, ...PreTrainedModel, GenerationMixin)``;
    ``base_model_prefix`` names the backbone."""

    # Recurrent models cannot roll back their state (no assisted decoding), and keep their own
    # cache object: transformers' DynamicCache holds attention keys/values.
    _is_stateful = True

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False

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
        cache_params=None,
        **kwargs,
    ):
        # position_ids: unused (no positional encoding). cache_params: the name generate() uses for
        # models whose class name contains "mamba".
        kwargs.pop("return_dict", None)
        backbone = getattr(self, self.base_model_prefix)
        out = backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            past_key_values=past_key_values if past_key_values is not None else cache_params,
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
