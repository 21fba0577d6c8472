"""Small collectives over Python objects that several components share."""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def from_rank0(value: T, group: dist.ProcessGroup | None = None) -> T:
    """Rank 0's ``value`` on every rank of ``group`` (the default group when None); ``value`` itself
    where no process group is initialized. Every rank must call it; only rank 0's ``value`` is sent."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
