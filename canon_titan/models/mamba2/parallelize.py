"""Mamba2: FSDP/HSDP, activation checkpointing, compile, PP and FSDP's float8 all-gather; no tensor
parallelism (the reason is ``Mamba2Args.no_tensor_parallel``, which config checks and the model
config report)."""

from __future__ import annotations

from canon_titan.models.common.parallelize import parallelize_decoder


def parallelize_mamba2(model, *, parallel_dims, **kwargs):
    if parallel_dims.tp_enabled:
        raise ValueError(model.config.args.no_tensor_parallel)
    return parallelize_decoder(model, parallelize_block=None, parallel_dims=parallel_dims, **kwargs)
