"""Tensor-parallel helpers used inside model forwards (the plans are each family's
``parallelize.py``).

Replicated parameters whose gradients are partial sums: a parameter that every TP rank holds
whole but applies to its own share of the work (a norm or Canon layer inside a block's TP region
or on a sequence shard, the rows of a Canon-B/D weight for the rank's channels, a low-rank
bottleneck) is used as a plain local tensor, so its backward moves nothing and each rank's
gradient is its share. The plans mark such parameters (``partial_gradients``); after the step's
last backward, ``sum_partial_gradients`` sums all of them over the TP group in one all-reduce,
before the gradients are judged or clipped (as DDP's buckets, coalesced over the whole model)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

PARTIAL_GRADIENTS = "tp_partial_gradients"
"""The attribute naming a module's parameters whose gradients are partial sums over TP."""


def local(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A DTensor parameter as a plain tensor when the activation it meets is plain; its gradient
    comes back as this rank's, with no collective (complete where every rank computes the same,
    a partial sum where the parameter is marked with ``partial_gradients``)."""
    if isinstance(t, DTensor) and not isinstance(like, DTensor):
        return t.to_local()
    return t


def partial_gradients(module: torch.nn.Module, *names: str) -> None:
    """Mark ``module``'s parameters ``names`` (those it has) as getting partial-sum gradients. Kept
    on the module, not the parameter: FSDP replaces the parameters, not the modules."""
    marked = set(getattr(module, PARTIAL_GRADIENTS, ())) | {
        n for n in names if getattr(module, n, None) is not None
    }
    setattr(module, PARTIAL_GRADIENTS, tuple(sorted(marked)))


def marked_parameters(model_parts: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The parameters marked with ``partial_gradients``, each once, in module order."""
    params, seen = [], set()
    for part in model_parts:
        for module in part.modules():
            for name in getattr(module, PARTIAL_GRADIENTS, ()):
                param = getattr(module, name)
                if id(param) not in seen:
                    seen.add(id(param))
                    params.append(param)
    return params


def sum_partial_gradients(model_parts: list[torch.nn.Module], group) -> None:
    """Every marked parameter's gradient summed over ``group``: one all-reduce of their local
    gradients (under FSDP, this rank's shards: summing over TP and over FSDP commute), flattened
    together in their common dtype (float32 where they differ)."""
    grads = [
        g.to_local() if isinstance(g, DTensor) else g
        for g in (p.grad for p in marked_parameters(model_parts))
        if g is not None
    ]
    if not grads:
        return
    flat, parts = _flattened(grads)
    dist.all_reduce(flat, group=group)
    for g, total in zip(grads, parts(flat)):
        g.copy_(total)


def _flattened(tensors: list[torch.Tensor]):
    """``tensors`` as one flat tensor in their common dtype (float32 where they differ), and the
    function that cuts a tensor of that size back into their shapes."""
    dtypes = {t.dtype for t in tensors}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    return flat, lambda whole: [
        part.view_as(t) for part, t in zip(whole.split([t.numel() for t in tensors]), tensors)
    ]


def _all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    out = funcol.all_reduce(x.contiguous(), "sum", group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


class _AllReduceSum(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient: every rank uses the sum. Functional
    collectives, which torch.compile traces (the in-place ``dist`` ones break the graph)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_sum(grad, ctx.group), None


def tp_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-reduce (sum) over ``group``."""
    return _AllReduceSum.apply(x, group)


def tp_sum_together(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """``tp_sum`` of each of ``tensors`` (per-rank partial sums, such as a flat norm's sums of
    squares), in one all-reduce each way (in their common dtype, float32 where they differ)."""
    if not tensors:
        return []
    flat, parts = _flattened(tensors)
    return [part.to(t.dtype) for part, t in zip(parts(tp_sum(flat, group)), tensors)]


class ChannelShard:
    """Which channels of a per-channel weight one TP rank applies, when its inputs come from
    column-sharded projections: each input (q, k, v; gate, up) holds a contiguous 1/size of its
    channels, so the rank needs those rows of each input's block of the weight. The full weight
    stays replicated: every rank's rows get gradients only from that rank, so the weight is marked
    with ``partial_gradients``.
    """

    def __init__(self, rank: int, size: int, group):
        self.rank, self.size, self.group = rank, size, group

    def rows(self, weight: torch.Tensor, local_sizes: list[int]) -> list[torch.Tensor]:
        """This rank's rows for consecutive inputs of ``local_sizes`` channels each (per rank)."""
        parts, offset = [], 0
        for size in local_sizes:
            parts.append(weight[offset + self.rank * size : offset + (self.rank + 1) * size])
            offset += size * self.size
        if offset != weight.shape[0]:
            raise ValueError(
                f"inputs of {local_sizes} channels per rank x {self.size} ranks do not cover the "
                f"{weight.shape[0]} channels of the weight"
            )
        return parts
