"""The device the kernel tests run on, and proof that a call took the kernel path.

On a machine with a GPU every kernel test runs on CUDA tensors; without one, on CPU tensors in
Triton's interpreter (conftest.py sets TRITON_INTERPRET=1). A backend asked for a Triton kernel
falls back to torch where the kernel cannot run (a CPU tensor without the interpreter, an
unsupported kernel size), and a test comparing it with torch would then compare torch with torch:
``kernel_path`` fails such a test, by counting the canon_titan custom ops (the only way into the
kernels) that ran.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"


class _CustomOpCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "canon_titan":
            self.calls[func._opname] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def kernel_path(*ops: str):
    """Fails unless each of the canon_titan custom ops ``ops`` (e.g. ``"canon_conv"``,
    ``"canon_conv_backward"``) ran inside the block; yields the counts of all that ran."""
    mode = _CustomOpCalls()
    with mode:
        yield mode.calls
    missing = [op for op in ops if not mode.calls[op]]
    if missing:
        raise AssertionError(
            f"kernel path not taken: canon_titan::{', '.join(missing)} never ran (the backend fell "
            f"back to torch); custom ops that ran: {dict(mode.calls) or 'none'}"
        )


def randn(gen: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    """Drawn on the CPU (the same numbers on every device), then moved to ``DEVICE``."""
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)
