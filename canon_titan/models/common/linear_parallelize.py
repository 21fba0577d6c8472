"""Tensor parallelism of a linear-model block, by head (the recurrences of different heads never
meet); each family names its mixer's layout (``MixerLayout``):
- q/k/v, the up-projections of the rank-16 gates and per-head projections are column-sharded,
  o_proj row-sharded; per-head parameters (A_log, dt_bias) are sharded with the heads. The rank-16
  down-projections stay replicated: every rank computes the whole bottleneck inside the block's TP
  region (``ReplicatedLinear``), its gradients partial sums like the region's.
- The short convolutions (b) on q/k/v are depthwise: each rank applies the rows of its channels
  (``ChannelShard``), the full weight replicated, its gradient a partial sum
  (``partial_gradients``).
- The per-head gated RMSNorm's weight is shared by all heads: replicated, its gradient a partial
  sum.
- The MLP, Canon-A/C/D, sequence parallelism, embedding and output as for Llama.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from canon_titan.models.common.parallelize import (
    ReplicatedLinear,
    channel_shard,
    feed_forward_plan,
    parallelize_block_plan,
    region_plan,
)
from canon_titan.models.common.tensor_parallel import partial_gradients


@dataclass(frozen=True)
class MixerLayout:
    """How a mixer's tensors are laid out over the TP ranks."""

    colwise: tuple[str, ...]
    """Column-sharded linears (by output channel = by head)."""
    replicated: tuple[str, ...]
    """Linears every rank applies whole (the low-rank bottlenecks)."""
    per_head: tuple[str, ...]
    """Parameters with one entry per head, sharded with the heads."""
    gated_norm: str
    """The per-head gated RMSNorm, whose shared weight's gradient is a partial sum."""


def parallelize_block(block, tp_mesh, enable_sp: bool, *, layout: MixerLayout) -> None:
    mixer = block.mixer
    for name in layout.per_head:
        param = getattr(mixer, name)
        mixer.register_parameter(name, nn.Parameter(distribute_tensor(param, tp_mesh, [Shard(0)])))
    partial_gradients(getattr(mixer, layout.gated_norm), "weight")
    for conv in (mixer.q_conv1d, mixer.k_conv1d, mixer.v_conv1d):
        if conv is not None:
            channel_shard(conv, tp_mesh)
    residual = Shard(1) if enable_sp else Replicate()
    plan = {f"mixer.{name}": ColwiseParallel() for name in layout.colwise}
    plan.update({f"mixer.{name}": ReplicatedLinear() for name in layout.replicated})
    plan["mixer.o_proj"] = RowwiseParallel(output_layouts=residual)
    plan.update(feed_forward_plan(block, tp_mesh, residual))
    plan.update(
        region_plan(
            block,
            (("canonA", "mixer_norm", "mixer"), ("canonC", "ffn_norm", "feed_forward")),
            enable_sp,
        )
    )
    parallelize_block_plan(block, tp_mesh, plan)
