"""Tensor parallelism of a Llama block, exact with Canon layers (the rest is common):
- q/k/v and gate/up projections are column-sharded, wo and w2 row-sharded;
- Canon-B and Canon-D are depthwise, so each rank applies the rows of its own q/k/v (gate/up)
  channels (``ChannelShard``); the full weight stays replicated, its gradient a partial sum;
- the flat QK-norm spans all heads: its weight is sharded with the columns and the mean square
  is summed over the TP group;
- Canon-A/C, the TP regions and sequence parallelism as every family (``common.parallelize``).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from canon_titan.models.common.parallelize import (
    channel_shard,
    feed_forward_plan,
    parallelize_block_plan,
    parallelize_decoder,
    region_plan,
)


def parallelize_block(block, tp_mesh, enable_sp: bool) -> None:
    attn = block.attention
    for norm in (attn.q_norm, attn.k_norm):
        if norm is not None:
            norm.weight = nn.Parameter(distribute_tensor(norm.weight, tp_mesh, [Shard(0)]))
            norm.tp_group = tp_mesh.get_group()
    if attn.canonB is not None:
        channel_shard(attn.canonB, tp_mesh)
    residual = Shard(1) if enable_sp else Replicate()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
        **feed_forward_plan(block, tp_mesh, residual),
        **region_plan(
            block,
            (("canonA", "attention_norm", "attention"), ("canonC", "ffn_norm", "feed_forward")),
            enable_sp,
        ),
    }
    parallelize_block_plan(block, tp_mesh, plan)


def parallelize_llama(model, **kwargs):
    return parallelize_decoder(model, parallelize_block=parallelize_block, **kwargs)
