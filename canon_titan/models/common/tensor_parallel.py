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


class _SumTogether(torch.autograd.Function):
    """One all-reduce each way for a layer's small TP sums: the forward sums ``partials`` (per-rank
    partial sums, such as a flat norm's sum of squares) over ``group``; ``replicated`` pass through
    unchanged (weights each rank applies to its own channels only), and the backward sums their
    gradients and those of the summed partials, in one all-reduce."""

    @staticmethod
    def forward(ctx, group, n_replicated, *tensors):
        ctx.group = group
        replicated, partials = tensors[:n_replicated], tensors[n_replicated:]
        return (*(t.view_as(t) for t in replicated), *_sum_flat(partials, group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_sum_flat(grads, ctx.group))


def _sum_flat(tensors, group) -> tuple[torch.Tensor, ...]:
    """``tensors`` summed over ``group`` in one all-reduce of their concatenation (in their common
    dtype, float32 where they differ)."""
    if not tensors:
        return ()
    dtypes = {t.dtype for t in tensors}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    total = _all_reduce_sum(torch.cat([t.reshape(-1).to(dtype) for t in tensors]), group)
    return tuple(part.view_as(t).to(t.dtype) for part, t in zip(total.split([t.numel() for t in tensors]), tensors))


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

    def sum_together(self, weights: list[torch.Tensor], partials: list[torch.Tensor] = ()
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``weights`` with their gradients summed over the TP group, and ``partials`` summed over it:
        one all-reduce in the forward (when there are partials) and one in the backward."""
        out = _SumTogether.apply(self.group, len(weights), *weights, *partials)
        return list(out[:len(weights)]), list(out[len(weights):])

    def rows(self, weight: torch.Tensor, local_sizes: list[int]) -> list[torch.Tensor]:
        """This rank's rows for consecutive inputs of ``local_sizes`` channels each (per rank), of a
        weight whose gradient ``sum_together`` sums."""
        parts, offset = [], 0
        for size in local_sizes:
            parts.append(weight[offset + self.rank * size : offset + (self.rank + 1) * size])
            offset += size * self.size
        if offset != weight.shape[0]:
            raise ValueError(f"inputs of {local_sizes} channels per rank x {self.size} ranks do not cover the "
                             f"{weight.shape[0]} channels of the weight")
        return parts
