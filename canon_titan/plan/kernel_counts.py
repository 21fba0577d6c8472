"""What each Triton kernel launch of a custom-op call executes, counted from its compiled kernels on
a CPU, and kept: the counting half of ``kernel_cost`` (which prices the counts on a GPU).

A custom op of canon-titan (the Canon op, fla's GLA and gated delta rule, mamba-ssm's SSD) is run
from its own body on meta tensors at a call's arguments (``launches``: its kernel launches recorded,
none run), and each launch compiled for sm_90 at every configuration it may run with and counted
(``canon_titan.kernels.sass``): ``LaunchCount``. Compiled code is kept by its compile key, a call's
counts by the call and the code that counts it (``cache_folder``: ``$XDG_CACHE_HOME/canon-titan/
kernel-cost``); a call not counted yet is counted by a process of its own (``python -m
canon_titan.plan.kernel_counts FOLDER < calls.json``: the real Triton, not its interpreter; fla and
mamba-ssm imported as on an H100, ``_as_hopper``)."""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import importlib.metadata
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from canon_titan.tools.fileio import write_atomic


@dataclass
class LaunchCount:
    """One kernel launch at one configuration: what it executes."""

    kernel: str
    config: str
    programs: int
    num_warps: int
    registers: int
    spill_bytes: int
    bytes: int
    """Its tensor arguments' bytes, each distinct tensor once."""
    executed: dict[str, float]
    """Class (``sass.CLASSES``) -> warp instructions of the whole launch."""
    mma_flops: float
    """Its MMA instructions' FLOPs, bf16-equivalent."""
    compile_s: float = 0.0
    """Triton's compile of the configuration on the machine that counted it."""
    matched: bool = True
    """Its loops' trip counts matched the compiled loops one by one (``sass.Executed.matched``)."""
    compile_key: str = ""
    """What Triton compiled (``sass.compile_key``): one compile per key, whatever the launch."""

    def per_element(self, elements: int) -> float:
        """Thread instructions per element of ``elements``."""
        return 32 * sum(self.executed.values()) / elements


# ------------------------------------------------------------------------------------- calls


def spec(value):
    """A custom op's argument as JSON: a tensor's shape, strides, storage offset and dtype."""
    import torch

    if isinstance(value, torch.Tensor):
        return [
            "tensor",
            list(value.shape),
            list(value.stride()),
            int(value.storage_offset()),
            str(value.dtype).removeprefix("torch."),
        ]
    if isinstance(value, (list, tuple)):
        return [spec(v) for v in value]
    return value


def _meta(value):
    import torch

    if isinstance(value, list) and value and value[0] == "tensor":
        _, shape, stride, offset, dtype = value
        extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s)
        base = torch.empty(offset + extent, dtype=getattr(torch, dtype), device="meta")
        return base.as_strided(shape, stride, offset)
    if isinstance(value, list):
        return [_meta(v) for v in value]
    return value


def calls_of(run, namespace: str = "canon_titan") -> list[tuple[str, list]]:
    """The custom-op calls of ``namespace`` that ``run()`` makes (on meta or fake tensors): (op,
    argument ``spec``s) in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Calls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == namespace:
                calls.append((func._schema.name, spec(list(args))))
            return func(*args, **(kwargs or {}))

    with Calls():
        run()
    return calls


TUNING = ("canon_titan.kernels.tuning",)
"""The kernel tuning rules (which autotuning candidates a launch may run with)."""
KERNEL_MODULES = (
    "canon_titan.kernels.canon",
    "canon_titan.kernels.gla",
    "canon_titan.kernels.delta_rule",
    "canon_titan.kernels.ssd",
)
"""The modules that define canon-titan's custom ops with Triton kernels."""


def _definition(op: str):
    """The Python definition of custom op ``op`` (``namespace::name``): its body is ``_init_fn``."""
    from torch._library.custom_ops import _maybe_get_opdef

    for name in (*KERNEL_MODULES, *TUNING):
        importlib.import_module(name)
    definition = _maybe_get_opdef(op)
    if definition is None:
        raise KeyError(f"{op} is not a custom op of {', '.join(KERNEL_MODULES)}")
    return definition


def launches(op: str, args: list):
    """Every kernel launch a call of custom op ``op`` (``namespace::name``) makes at ``args``
    (``spec``s), from its own body run on meta tensors: ``sass.Launch``es."""
    from canon_titan.kernels import sass

    body = _definition(op)._init_fn
    values = [_meta(a) for a in args]
    return sass.record_launches(lambda: body(*values))


def launch_counts(launch, codes=None) -> list[LaunchCount]:
    """A launch at each configuration it may run with, counted (compiled code from ``codes``, a
    compile key -> ``sass.Code`` cache, where it has it)."""
    from canon_titan.kernels import sass

    out = []
    for config in launch.configs():
        key = sass.compile_key(launch, config)
        code = codes.get(key) if codes is not None else None
        if code is None:
            code = sass.analyse(sass.compile_launch(launch, config), launch.name, config.label)
            if codes is not None:
                codes.put(key, code)
        run = sass.execute(code, launch.bound_args(config), launch.programs(config))
        out.append(
            LaunchCount(
                launch.name,
                config.label,
                run.programs,
                code.num_warps,
                code.registers,
                code.spill_store_bytes + code.spill_load_bytes,
                launch.bytes(),
                run.executed,
                run.mma_flops,
                compile_s=code.compile_seconds,
                matched=run.matched,
                compile_key=key,
            )
        )
    return out


# ------------------------------------------------------------------------------------- cache


def cache_folder() -> Path:
    return (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        / "canon-titan"
        / "kernel-cost"
    )


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


@functools.cache
def _file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _counting_code() -> tuple[str, ...]:
    """What the counts depend on besides the kernels: the counting code and the compiler."""
    here = Path(__file__).resolve()
    kernels = here.parents[1] / "kernels"
    import triton

    return (
        _file_digest(kernels / "sass.py"),
        _file_digest(kernels / "trips.py"),
        triton.__version__,
    )


def call_key(op: str, args: list) -> str:
    """A call's cache key: the op, its arguments, the modules that define the ops and the kernel
    tuning rules, the counting code (this module's too), the kernel packages' versions, and
    whether the full autotuning search is on (``CANON_TITAN_FULL_AUTOTUNE``: it changes which
    configurations a launch may run with). (By every op module's source: a ``triton_op``'s body is
    a wrapper of torch's, an interpreter run's custom op's the function itself.)"""
    from canon_titan.kernels.tuning import FULL_AUTOTUNE_ENV

    _definition(op)
    sources = [_file_digest(sys.modules[name].__file__) for name in (*KERNEL_MODULES, *TUNING)]
    sources += [_file_digest(__file__), *_counting_code()]
    full = os.environ.get(FULL_AUTOTUNE_ENV) == "1"
    return _digest(
        op, args, sources, _version("flash-linear-attention"), _version("mamba-ssm"), full
    )


class Codes:
    """Compiled code counted (``sass.Code``), on disk by compile key and counting code."""

    def __init__(self, folder: Path):
        self.folder = folder / "codes"
        self.salt = _digest(*_counting_code())[:8]

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}-{self.salt}.json"

    def get(self, key: str):
        from canon_titan.kernels import sass

        path = self._path(key)
        return sass.Code.from_json(json.loads(path.read_text())) if path.is_file() else None

    def put(self, key: str, code) -> None:
        write_atomic(self._path(key), json.dumps(code.to_json()))


def _call_path(folder: Path, key: str) -> Path:
    return folder / "calls" / f"{key}.json"


def cached(op: str, args: list, folder: Path | None = None) -> list[list[LaunchCount]] | None:
    """Per launch of the call, its configurations' counts, if counted before."""
    path = _call_path(folder or cache_folder(), call_key(op, args))
    if not path.is_file():
        return None
    return [[LaunchCount(**c) for c in configs] for configs in json.loads(path.read_text())]


def count_call(op: str, args: list, folder: Path | None = None) -> list[list[LaunchCount]]:
    """Count a call's launches here (the real Triton must be importable, not its interpreter)."""
    folder = folder or cache_folder()
    codes = Codes(folder)
    counted = [launch_counts(launch, codes) for launch in launches(op, args)]
    write_atomic(
        _call_path(folder, call_key(op, args)),
        json.dumps([[asdict(c) for c in configs] for configs in counted]),
    )
    return counted


# ------------------------------------------------------------------------------------- a GPU
# process


def _as_hopper() -> None:
    """Make this process look like one on an H100 to the kernel packages that ask (fla builds its
    autotuning lists from the device's name, capability and shared memory; mamba-ssm asks for the
    multiprocessor count): Triton's active driver and torch.cuda's queries answer as an sm_90 part
    would. Nothing runs on it; for the worker only."""
    import contextlib
    import types

    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    properties = {
        "max_shared_mem": 232448,
        "multiprocessor_count": 132,
        "max_num_regs": 65536,
        "warpSize": 32,
    }

    class Driver:
        utils = types.SimpleNamespace(get_device_properties=lambda device: dict(properties))

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

        def get_device_interface(self):
            return torch.cuda

    triton.runtime.driver.set_active(Driver())
    device = types.SimpleNamespace(
        name="NVIDIA H100 80GB HBM3",
        major=9,
        minor=0,
        multi_processor_count=132,
        shared_memory_per_block_optin=232448,
        shared_memory_per_block=49152,
        total_memory=80 * 2**30,
        warp_size=32,
    )
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.device = lambda index: contextlib.nullcontext()  # mamba-ssm's launches enter it
    torch.cuda.get_device_name = lambda *a, **k: device.name
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: device


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "folder", help="count the calls on stdin (JSON: [[op, args], ...]) into this cache"
    )
    args = parser.parse_args(argv)
    _as_hopper()
    for op, call_args in json.loads(sys.stdin.read()):
        count_call(op, call_args, Path(args.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
