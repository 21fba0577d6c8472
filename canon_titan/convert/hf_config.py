"""The ``config.json`` of an export, and the check that an imported one describes the run's model.

Llama without Canon layers, QK-norm or partial RoPE is transformers' own ``llama``; LlamaCanon and
the linear models (GLA5, GDN2, Mamba2) use our classes (``canon_titan.hf``) with the fields of the
PhysicsLM4 release's ``LlamaCanon``, ``GLACanon``, ``GatedDeltaNetCanon`` and ``Mamba2Canon``
configs (spec 3.3, 5.7), plus ``auto_map`` so transformers finds the modeling code shipped beside
the weights.
"""

from __future__ import annotations

from canon_titan.convert.dcp_io import ConversionError
from canon_titan.hf import HF_MODELS, HFModel
from canon_titan.models.gla5 import GATE_RANK, INIT_STD
from canon_titan.models.linear import SHORT_CONV_SIZE
from canon_titan.models.mamba2 import EMBEDDING_STD, EXPAND

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
CANON_DEFAULTS = {"canon_set": "", "canon_kernel": 4, "canon_residual": True, "canon_activation": False,
                  "canon_bias": False}
"""The Canon fields and their values for a Llama without Canon layers."""


def uses_rope(args) -> bool:
    """Llama and LlamaCanon; the linear models (which have a ``family``) have no positional encoding."""
    return getattr(args, "family", None) is None


def is_plain_llama(args) -> bool:
    return (uses_rope(args) and not getattr(args, "canon_set", "") and not args.qk_norm
            and (args.rope_dim is None or args.rope_dim == args.head_dim))


def hf_model(args) -> HFModel | None:
    """Our transformers classes for the run's model; None for a plain Llama (transformers' own)."""
    family = getattr(args, "family", None)
    if family is not None:
        return HF_MODELS[family]
    return None if is_plain_llama(args) else HF_MODELS["LlamaCanon"]


CANON_BIAS_NOTE = ("canon_bias = true: the PhysicsLM4 release's LlamaCanon code cannot load this model (it has no "
                   "Canon bias and asserts on one); load it with the modeling code shipped in this folder")


def hf_config(args, rope_layout: str, dtype: str, max_seq_len: int, tokenizer: dict) -> dict:
    common = {
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.get("bos_token_id"),
        "eos_token_id": tokenizer.get("eos_token_id"),
        # transformers 5 reads "dtype", 4.x "torch_dtype".
        "dtype": DTYPE_NAMES[dtype],
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    classes = hf_model(args)
    if classes is None:
        # transformers 5 reads rope_parameters; 4.x (the release's 4.47) reads the top-level rope_theta and
        # would silently take 10000 without it.
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common, **_llama_shape(args),
                "max_position_embeddings": max_seq_len, "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False, "rope_theta": args.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta}}
    specific = _llama_canon(args, rope_layout) if uses_rope(args) else _LINEAR_CONFIGS[args.family](args)
    return {
        "architectures": [classes.architecture],
        "model_type": classes.classes()[0].model_type,
        "auto_map": classes.auto_map,
        **common,
        # For evaluation tools: the training sequence length (the linear models have no positional limit).
        "max_position_embeddings": max_seq_len,
        **specific,
        **{field: getattr(args, field, default) for field, default in CANON_DEFAULTS.items()},
        **({"canon_titan_note": CANON_BIAS_NOTE} if getattr(args, "canon_bias", False) else {}),
    }


def _llama_shape(args) -> dict:
    return {
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
    }


def _llama_canon(args, rope_layout: str) -> dict:
    rope_dim = args.rope_dim or args.head_dim
    return {
        **_llama_shape(args),
        "rope_theta": args.rope_theta,
        "rope_dim": rope_dim,
        "partial_rotary_factor": rope_dim / args.head_dim,
        "rope_version": rope_layout,
        "qk_norm": args.qk_norm,
        "hidden_act": "silu",
    }


def _gla5(args) -> dict:
    return {
        "hidden_size": args.dim, "expand_k": 1, "expand_v": 2, "hidden_ratio": 4,
        "intermediate_size": args.hidden_dim, "num_hidden_layers": args.n_layers, "num_heads": args.n_heads,
        "num_kv_heads": None, "feature_map": None, "attn_mode": "chunk", "use_short_conv": "b" in args.canon_set,
        "conv_size": SHORT_CONV_SIZE, "use_output_gate": True, "output_gate_rank": GATE_RANK, "clamp_min": None,
        "hidden_act": "swish", "elementwise_affine": True, "norm_eps": args.norm_eps, "use_gk": True,
        "use_gv": False, "attn": None, "use_cache": True, "initializer_range": INIT_STD, "zeyuan_split_init": True,
        "zeyuan_layernorm": False, "fuse_norm": True, "fuse_swiglu": True, "fuse_cross_entropy": False,
        "use_l2warp": False,
    }


def _gdn2(args) -> dict:
    return {
        "attn_mode": "chunk", "hidden_size": args.dim, "expand_v": 2, "use_gate": True,
        "use_short_conv": "b" in args.canon_set, "conv_size": SHORT_CONV_SIZE, "head_dim": args.dim // args.n_heads,
        "num_heads": args.n_heads, "hidden_ratio": 4, "intermediate_size": args.hidden_dim, "hidden_act": "swish",
        "num_hidden_layers": args.n_layers, "norm_eps": args.norm_eps, "attn": None, "use_cache": True,
        "initializer_range": INIT_STD, "fuse_norm": True, "fuse_swiglu": True, "fuse_cross_entropy": False,
        "zeyuan_split_init": True, "output_gate_rank": GATE_RANK, "zeyuan_layernorm": False,
    }


def _mamba2(args) -> dict:
    return {
        "hidden_size": args.dim, "state_size": args.state_size, "num_hidden_layers": args.n_layers,
        "layer_norm_epsilon": args.norm_eps, "conv_kernel": SHORT_CONV_SIZE, "expand": EXPAND, "use_bias": False,
        "use_conv_bias": "b" in args.canon_set, "hidden_act": "silu", "initializer_range": EMBEDDING_STD,
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4, "time_step_limit": [0.0, float("inf")],
        "rescale_prenorm_residual": False, "residual_in_fp32": False, "use_cache": True, "n_groups": 1,
        "num_heads": args.n_heads, "head_dim": args.head_dim, "rms_norm": True, "chunk_size": args.chunk_size,
        "intermediate_size": args.hidden_dim, "mlp_type": "mlp10", "noconv1d": "b" not in args.canon_set,
    }


_LINEAR_CONFIGS = {"GLA5": _gla5, "GDN2": _gdn2, "Mamba2": _mamba2}
NOT_MATHS = {"architectures", "auto_map", "model_type", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
             "pad_token_id", "max_position_embeddings", "use_cache", "initializer_range", "attn_mode", "fuse_norm",
             "fuse_swiglu", "fuse_cross_entropy", "zeyuan_split_init", "time_step_min", "time_step_max",
             "time_step_floor", "rescale_prenorm_residual", "residual_in_fp32", "chunk_size", "canon_titan_note",
             "rope_version", "partial_rotary_factor", "rope_parameters", "zeyuan_layernorm", "use_l2warp"}
"""Fields of an export's config.json that do not change the function the model computes: ids,
initialisation, implementation choices (fused kernels, the scan's block length), and RoPE fields
that are compared in resolved form (``rope_dim``, ``rope_theta``) or that only say how q/k rows
are laid out (``rope_version``, handled by the import). Every other field is compared on import."""


def canon_letters(canon_set: str) -> set[str]:
    """The positions a canon_set enables ("bb", the release's spelling of b, counts as b)."""
    return set(canon_set.replace("bb", "b"))


def _config_class(hf: dict, args, where: str):
    family = getattr(args, "family", None)
    if family is not None:
        config_cls, _ = HF_MODELS[family].classes()
        if hf.get("model_type") != config_cls.model_type:
            raise ConversionError(f"{where}: model_type {hf.get('model_type')!r} is not {config_cls.model_type!r} "
                                  f"(the run's model is {family})")
        return config_cls
    model_type = hf.get("model_type")
    if model_type == "llama":
        if not is_plain_llama(args):
            raise ConversionError(f"{where}: a plain Llama checkpoint cannot fill a model with Canon layers, "
                                  "QK-norm or partial RoPE")
        from transformers import LlamaConfig

        return LlamaConfig
    if model_type == "LlamaCanon":
        return HF_MODELS["LlamaCanon"].classes()[0]
    raise ConversionError(f"{where}: model_type {model_type!r} is not 'llama' or 'LlamaCanon'")


def _resolved(config_cls, fields: dict, where: str):
    """The config as transformers reads it: the class's (the release's) defaults for absent fields."""
    try:
        return config_cls.from_dict(fields)
    except (ValueError, TypeError) as e:
        raise ConversionError(f"{where}: {e}") from None


def _rope_theta(config) -> float | None:
    parameters = getattr(config, "rope_parameters", None) or {}
    return parameters.get("rope_theta", getattr(config, "rope_theta", None))


def check_hf_config(hf: dict, args, where: str) -> bool:
    """The HF config must describe the run's model: every field that changes the maths, as
    transformers resolves it (absent fields take the class's defaults, ``rope_dim: null`` means the
    whole head), equals the value an export of the run would write. Returns whether q/k use the
    rotate-half layout."""
    config_cls = _config_class(hf, args, where)
    found = _resolved(config_cls, hf, where)
    expected_fields = hf_config(args, "lingua", "fp32", 0, {})
    expected = _resolved(config_cls, expected_fields, "the run config")
    keys = [k for k in expected_fields if k not in NOT_MATHS]
    if uses_rope(args):
        keys += ["rope_theta", "head_dim"] + (["rope_dim"] if config_cls.model_type == "LlamaCanon" else [])
    for key in dict.fromkeys(keys):
        got, want = ((_rope_theta(found), _rope_theta(expected)) if key == "rope_theta"
                     else (getattr(found, key, None), getattr(expected, key, None)))
        if key == "canon_set" and canon_letters(got or "") == canon_letters(want or ""):
            continue
        if got != want:
            raise ConversionError(f"{where}: {key} is {got!r}, the run config expects {want!r}")
    rope_type = (getattr(found, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ConversionError(f"{where}: rope_parameters has rope_type {rope_type!r}; canon-titan's models use plain "
                              "RoPE ('default')")
    return config_cls.model_type == "llama" or hf.get("rope_version") == "huggingface"
