"""What fla's and mamba-ssm's Triton kernels need to run in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``: the tests, and CPU runs that force the ``fla`` or ``mamba_ssm`` backend).
``prepare(package)`` runs before the backend's first kernel under the interpreter; nothing changes
otherwise. None of it changes a kernel.

- Autotuning benchmarks every configuration through the GPU driver ("0 active drivers"): with equal
  timings the first configuration is taken.
- The interpreter's loop counters are Python ints; kernels that call ``i_t.to(tl.int64)`` on one
  get an int subclass with a no-op ``.to()`` through a module-level ``range``.
- mamba-ssm launches inside ``torch.cuda.device(x.device.index)`` and sizes some grids by the GPU's
  multiprocessor count; on a machine without CUDA both become neutral for CPU tensors.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pkgutil
import types

import torch

KERNEL_MODULES = {"fla": "fla.ops", "mamba_ssm": "mamba_ssm.ops.triton"}


class _Int(int):
    def to(self, *args, **kwargs):
        return self


def _interpreter_range(*args):
    # Bounds may be the interpreter's one-element tensors, which Triton 3.6 cannot turn into an
    # index under NumPy 2.
    args = [int(a.handle.data.item()) if hasattr(a, "handle") else a for a in args]
    return (_Int(i) for i in range(*args))


@functools.cache
def _no_autotuning_benchmark() -> None:
    import triton.runtime.autotuner as autotuner

    autotuner.Autotuner.do_bench = property(
        lambda self: lambda fn, quantiles=None, **kw: [1.0, 1.0, 1.0]
    )


@functools.cache
def _neutral_cuda_device() -> None:
    if torch.cuda.is_available():
        return
    cuda_device = torch.cuda.device
    torch.cuda.device = lambda index: (
        contextlib.nullcontext() if index is None else cuda_device(index)
    )
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        multi_processor_count=1
    )


@functools.cache
def prepare(package: str) -> None:
    """Make ``package``'s kernels (``fla`` or ``mamba_ssm``, imported) runnable in the
    interpreter."""
    _no_autotuning_benchmark()
    _neutral_cuda_device()
    root = importlib.import_module(KERNEL_MODULES[package])
    for info in pkgutil.walk_packages(root.__path__, prefix=root.__name__ + "."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # parts of the package that need CUDA or optional dependencies
            continue
        module.range = _interpreter_range
