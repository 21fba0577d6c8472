"""What fla's and mamba-ssm's Triton kernels need to run in Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1). Test-only: the product code calls the packages as they are.

- Autotuning benchmarks every configuration with the GPU driver ("0 active drivers"): with equal
  timings the first configuration is taken.
- The interpreter's loop counters are Python ints; kernels that call ``i_t.to(tl.int64)`` on one
  get an int subclass with a no-op ``.to()`` through a module-level ``range``.
- mamba-ssm launches inside ``torch.cuda.device(x.device.index)`` and sizes some grids by the
  GPU's multiprocessor count; on CPU tensors both become neutral.
- mamba-ssm's package ``__init__`` imports its CUDA selective-scan extension, which a
  ``MAMBA_SKIP_CUDA_BUILD=TRUE`` install does not build; its Triton SSD kernels
  (``mamba_ssm.ops.triton``) do not need it, so the package is entered without running that file.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import pkgutil
import sys
import types

import torch

_patched = False


class _Int(int):
    def to(self, *args, **kwargs):
        return self


def _interpreter_range(*args):
    return (_Int(i) for i in range(*args))


def _enter_mamba_ssm_without_init() -> bool:
    if "mamba_ssm" in sys.modules:
        return True
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None:
        return False
    package = types.ModuleType("mamba_ssm")
    package.__path__ = list(spec.submodule_search_locations)
    package.__version__ = "stub: package __init__ not run"
    sys.modules["mamba_ssm"] = package
    return True


def _patch_kernel_modules(package: str) -> None:
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # parts of the package that need CUDA or optional dependencies
            continue
        module.range = _interpreter_range


def apply() -> None:
    global _patched
    if _patched:
        return
    import triton.runtime.autotuner as autotuner

    autotuner.Autotuner.do_bench = property(lambda self: lambda fn, quantiles=None, **kw: [1.0, 1.0, 1.0])
    if importlib.util.find_spec("fla") is not None:
        _patch_kernel_modules("fla.ops")
    if _enter_mamba_ssm_without_init():
        _patch_kernel_modules("mamba_ssm.ops.triton")
    if not torch.cuda.is_available():
        original_device = torch.cuda.device

        def device(index):
            return contextlib.nullcontext() if index is None else original_device(index)

        torch.cuda.device = device
        torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=1)
    _patched = True
