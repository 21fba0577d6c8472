"""Mamba2: FSDP/HSDP, activation checkpointing, compile and PP; no tensor parallelism (the reason is
``Mamba2Args.no_tensor_parallel``, which config checks and the model config report)."""

from __future__ import annotations

from canon_titan.models.common.parallelize import apply_ac_compile_fsdp


def parallelize_mamba2(model, *, parallel_dims, **kwargs):
    if parallel_dims.tp_enabled:
        raise ValueError(model.config.args.no_tensor_parallel)
    apply_ac_compile_fsdp(model, parallel_dims=parallel_dims, **kwargs)
    return model
