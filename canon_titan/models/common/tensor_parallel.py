"""Tensor-parallel helpers used inside model forwards (the plans are each family's ``parallelize.py``)."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial


def local(t: torch.Tensor | None, like: torch.Tensor, partial_gradient: bool = False) -> torch.Tensor | None:
    """A DTensor parameter as a plain tensor when the activation it meets is plain.

    For a parameter replicated over the TP mesh whose local gradient is already the full,
    identical gradient on every rank; or, with ``partial_gradient``, one applied inside a block's
    TP region (``common.parallelize``), where each rank's local gradient is a partial sum: it is
    returned as a ``Partial`` gradient, which FSDP2 sums over the mesh.
    """
    if isinstance(t, DTensor) and not isinstance(like, DTensor):
        if partial_gradient:
            return t.to_local(grad_placements=tuple(Partial() if p.is_replicate() else p for p in t.placements))
        return t.to_local()
    return t


def _all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    out = funcol.all_reduce(x.contiguous(), "sum", group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over ``group``. Functional
    collectives, which torch.compile traces (the in-place ``dist`` ones break the graph)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_sum(grad, ctx.group), None


class _AllReduceSum(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient: every rank uses the sum."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_sum(grad, ctx.group), None


def sum_gradients(x: torch.Tensor, group) -> torch.Tensor:
    """Identity whose backward sums the gradient over ``group``: for a replicated weight that each
    TP rank applies to its own heads only."""
    return _SumGradients.apply(x, group)


def tp_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-reduce (sum) over ``group``."""
    return _AllReduceSum.apply(x, group)


class ChannelShard:
    """Which channels of a per-channel weight one TP rank applies, when its inputs come from
    column-sharded projections: each input (q, k, v; gate, up) holds a contiguous 1/size of its
    channels, so the rank needs those rows of each input's block of the weight. The full weight
    stays replicated: every rank's rows get gradients only from that rank, so the gradient is
    summed over the TP group.
    """

    def __init__(self, rank: int, size: int, group):
        self.rank, self.size, self.group = rank, size, group

    def rows(self, weight: torch.Tensor, local_sizes: list[int]) -> list[torch.Tensor]:
        """This rank's rows for consecutive inputs of ``local_sizes`` channels each (per rank)."""
        weight = _SumGradients.apply(weight, self.group)
        parts, offset = [], 0
        for size in local_sizes:
            parts.append(weight[offset + self.rank * size : offset + (self.rank + 1) * size])
            offset += size * self.size
        if offset != weight.shape[0]:
            raise ValueError(f"inputs of {local_sizes} channels per rank x {self.size} ranks do not cover the "
                             f"{weight.shape[0]} channels of the weight")
        return parts
