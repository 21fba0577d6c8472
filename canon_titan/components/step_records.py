"""Small per-step device values the host reads without stalling the device: each is copied to host
memory as the step makes it (a non-blocking copy, marked by an event), and read once the host has
queued later work: the next step's, or at once where the host must decide on the step itself."""

from __future__ import annotations

from collections import deque

import torch
from torch._subclasses.fake_tensor import FakeTensor


class StepRecords:
    def __init__(self):
        self._pending: deque[tuple[int, torch.Tensor, torch.Event | None]] = deque()

    def put(self, step: int, values: torch.Tensor) -> None:
        if isinstance(values, FakeTensor):
            return  # a planned step (``canon-titan plan``): no values to read
        on_device = values.device.type != "cpu"
        host = torch.empty(values.shape, dtype=values.dtype, device="cpu", pin_memory=on_device)
        host.copy_(values, non_blocking=True)
        event = None
        if on_device:
            event = torch.Event(device=values.device)
            event.record()
        self._pending.append((step, host, event))

    def take(self, through: int) -> list[tuple[int, list[float]]]:
        """The values put for every step up to ``through`` not yet taken, oldest first; waits for
        the device only as far as the newest of them."""
        taken = []
        while self._pending and self._pending[0][0] <= through:
            step, host, event = self._pending.popleft()
            if event is not None:
                event.synchronize()
            taken.append((step, host.tolist()))
        return taken
