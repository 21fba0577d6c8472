"""Host memory for what a training step copies to the GPU, and the copy itself.

A ``non_blocking`` copy from pinned (page-locked) host memory is a DMA queued on the stream; from
pageable memory the driver first stages the data through a pinned buffer of its own and may wait
for the stream to do so (CUDA's "API synchronization behavior"), and a non-contiguous source is
first made contiguous in another pageable temporary. So the data loaders build each batch in one
flat pinned buffer (``host_buffer``), its tensors (inputs, labels, positions) views of it, and the
step copies that buffer once and takes the same views of the copy on the device (``to_device``).

On a machine without CUDA there is no pinned memory: a buffer asked for pinned is a plain one,
marked as standing in for pinned memory, so that ``is_pinned`` (what
``scripts/benchmarks/host_syncs.py`` asks of every copy to the device on a CPU run) tells it from a
pageable tensor as a GPU run would.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

_STANDS_IN_FOR_PINNED = WeakIdKeyDictionary()


def host_buffer(numel: int, dtype: torch.dtype, *, pin: bool = True) -> torch.Tensor:
    """An uninitialised flat host tensor, pinned when ``pin`` and CUDA is available (elsewhere a
    plain one that ``is_pinned`` takes for pinned)."""
    if pin and torch.cuda.is_available():
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    buffer = torch.empty(numel, dtype=dtype)
    if pin:
        _STANDS_IN_FOR_PINNED[buffer] = True
    return buffer


def host_value(value, dtype: torch.dtype) -> torch.Tensor:
    """A 0-d host tensor holding ``value``, in pinned memory (``host_buffer``)."""
    return host_buffer(1, dtype).fill_(value).view(())


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in pinned memory: itself when it is there (``is_pinned``), else a pinned copy
    where CUDA is available, or on a CPU run itself, marked as standing in for one."""
    if is_pinned(tensor):
        return tensor
    if torch.cuda.is_available():
        return tensor.pin_memory()
    _STANDS_IN_FOR_PINNED[tensor] = True
    return tensor


def is_pinned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in pinned memory (or in a buffer standing in for it on a CPU run)."""
    root = tensor if tensor._base is None else tensor._base
    return root.is_pinned() or root in _STANDS_IN_FOR_PINNED


def to_device(tensors: list, device: torch.device) -> list:
    """``tensors`` on ``device``, each copy queued (``non_blocking``); tensors that are views of one
    contiguous buffer (a batch's) are copied as that buffer, once, and viewed alike on the device.
    Anything but a tensor is returned as it is."""
    copies: dict[int, torch.Tensor] = {}

    def moved(value):
        if not isinstance(value, torch.Tensor):
            return value
        base = value._base
        if base is None or not base.is_contiguous() or base.storage_offset() != 0:
            return value.to(device, non_blocking=True)
        if id(base) not in copies:
            copies[id(base)] = base.to(device, non_blocking=True)
        return copies[id(base)].as_strided(value.size(), value.stride(), value.storage_offset())

    return [moved(value) for value in tensors]
