"""Parallelisms for the linear models: tensor parallelism (+SP) for GLA5 and GDN2, then the same
activation checkpointing, per-block compile and FSDP2/HSDP as Llama. PP is TorchTitan's
``pipeline_llm``, which calls this function on every stage.

Tensor parallelism, by head (the recurrences of different heads never meet):
- q/k/v, the up-projections of the rank-16 gates (GLA5's forget gate, the output gate) and GDN2's
  per-head b_proj/a_proj are column-sharded, o_proj row-sharded; A_log and dt_bias are sharded
  with the heads. The rank-16 down-projections stay replicated: every rank computes the whole
  bottleneck, and the column-sharded up-projection sums its input gradient over the group.
- The short convolutions (b) on q/k/v are depthwise: each rank applies the rows of its channels
  (``ChannelShard``), the full weight replicated with its gradient summed.
- The per-head gated RMSNorm's weight is shared by all heads: replicated, gradient summed.
- The MLP, Canon-A/C/D, sequence parallelism, embedding and output as for Llama.
Mamba2 has none: its gated RMSNorm spans all heads and its single B/C group feeds every head.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)

from canon_titan.models.gdn2 import GDN2Mixer
from canon_titan.models.gla5 import GLA5Mixer
from canon_titan.models.tensor_parallel import ChannelShard
from canon_titan.parallelize import apply_ac_compile_fsdp, apply_tp, sequence_parallel_plan

# mixer type -> (column-sharded linears, replicated linears, per-head parameters, gated norm)
_MIXER_LAYOUT = {
    GLA5Mixer: (("q_proj", "k_proj", "v_proj", "gk_proj.up", "g_proj.up"), ("gk_proj.down", "g_proj.down"),
                (), "g_norm"),
    GDN2Mixer: (("q_proj", "k_proj", "v_proj", "b_proj", "a_proj", "g_proj.up"), ("g_proj.down",),
                ("A_log", "dt_bias"), "o_norm"),
}


def _replicated_linear() -> PrepareModuleInputOutput:
    """A replicated weight on a plain, identical-on-every-rank input: a plain output back."""
    return PrepareModuleInputOutput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
        output_layouts=(Replicate(),), desired_output_layouts=(Replicate(),), use_local_output=True,
    )


def _shard_heads(mixer, tp_mesh, per_head: tuple[str, ...], norm: str) -> None:
    rank, size, group = tp_mesh.get_local_rank(), tp_mesh.size(), tp_mesh.get_group()
    for name in per_head:
        param = getattr(mixer, name)
        mixer.register_parameter(name, nn.Parameter(distribute_tensor(param, tp_mesh, [Shard(0)])))
    getattr(mixer, norm).tp_group = group
    for conv in (mixer.q_conv1d, mixer.k_conv1d, mixer.v_conv1d):
        if conv is not None:
            conv.channel_shard = ChannelShard(rank, size, group)


def _parallelize_linear_block(block, tp_mesh, enable_sp: bool) -> None:
    mixer, ffn = block.mixer, block.feed_forward
    if type(mixer) not in _MIXER_LAYOUT:
        raise ValueError(f"{type(mixer).__name__} does not support tensor parallelism; "
                         "use FSDP/HSDP and/or pipeline parallelism")
    colwise, replicated, per_head, norm = _MIXER_LAYOUT[type(mixer)]
    _shard_heads(mixer, tp_mesh, per_head, norm)
    if ffn.canonD is not None:
        ffn.canonD.channel_shard = ChannelShard(tp_mesh.get_local_rank(), tp_mesh.size(), tp_mesh.get_group())
    residual = Shard(1) if enable_sp else Replicate()
    plan = {f"mixer.{name}": ColwiseParallel() for name in colwise}
    plan.update({f"mixer.{name}": _replicated_linear() for name in replicated})
    plan["mixer.o_proj"] = RowwiseParallel(output_layouts=residual)
    plan["feed_forward.w1"] = ColwiseParallel()
    plan["feed_forward.w3"] = ColwiseParallel()
    plan["feed_forward.w2"] = RowwiseParallel(output_layouts=residual)
    if enable_sp:
        plan.update(sequence_parallel_plan(block, (("canonA", "mixer_norm", "mixer", 1),
                                                   ("canonC", "ffn_norm", "feed_forward", 1))))
    parallelize_module(block, tp_mesh, plan)


def parallelize_linear(model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder):
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.get_mesh("tp"), enable_sp=parallelism.enable_sequence_parallel,
                 parallelize_block=_parallelize_linear_block)
    apply_ac_compile_fsdp(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                          compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder)
    return model
