"""Counts what in a training step would make the host wait for a GPU, on a CPU run
(``tests/test_host_work.py`` holds a training step to it; ``host_step.py`` reports it).

On a GPU the host waits when it reads a value the device computes (``.item()``, ``float(t)``,
``.tolist()``, ``.cpu()``), when an op's output size depends on device values (``nonzero``, a
boolean index), and when it copies between host and device memory without ``non_blocking``. On a CPU
run every tensor is in host memory, so where each would live on a GPU is followed here, op by op: a
CPU trainer's device is ``cpu:0`` (TorchTitan gives it an index, as ``cuda:0``), so a tensor is on
the device when an op made it there (``device=cpu:0``, ``.to(cpu:0)``) or from a device tensor, and
on the host when the data loader gave it, when it was made from Python values or with the plain
``cpu`` device, or computed from host tensors only. A tensor made before counting started
(parameters, optimizer state) is on the device.

Reads are counted once they reach the dispatcher (``_local_scalar_dense``), and ``tolist``/``cpu``/
``numpy``/``to`` at the Python level, where a CPU tensor's own data is read without any op. A copy
from device to host memory with ``non_blocking`` is counted as a wait only when its host copy is
read (it arrives later on a GPU, behind an event the reader waits on: what it waits for is the
device's work up to the copy, which a read one step later finds done). A copy to the device with
``non_blocking`` from pageable host memory is counted as a wait: the driver stages it through a
pinned buffer of its own and may wait for the stream to do so (CUDA's "API synchronization
behavior"); so is one from a strided source, which ATen first copies into a pageable contiguous
temporary. Pinned is what
``canon_titan.tools.host_memory.is_pinned`` says: a GPU run's page-locked memory, or on a CPU run
the buffers the data loaders build their batches in, marked as standing in for it.
"""

from __future__ import annotations

import contextlib
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from canon_titan.tools.host_memory import is_pinned

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
SIZED_BY_VALUES = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
    aten.nonzero_static.default,
}
COPIES = {aten._to_copy.default, aten.copy_.default}


def _host_device(device) -> bool:
    """A plain ``cpu`` device (or none) named by code outside torch: the host. Inside torch it is a
    CPU tensor's own device, which on a GPU run would be the GPU (FSDP's buffers,
    ``x.to(grad.device)``)."""
    device = torch.device(device) if device is not None else None
    return (
        device is None or (device.type == "cpu" and device.index is None)
    ) and _caller_outside_torch()


_MACHINERY = ("_python_dispatch.py", "torch/_ops.py", "torch/_compile.py", "contextlib.py")
"""Frames between an op's caller and this mode (the dispatcher's Python, dynamo's disabling
wrapper)."""


def _caller_outside_torch() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name == __file__ or name.endswith(_MACHINERY) or "/torch/_dynamo/" in name):
            return "/torch/" not in name
        frame = frame.f_back
    return True


def _where(skip=("/torch/", "contextlib.py")) -> str:
    """The innermost frame outside torch and this file: who asked."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename != __file__ and not any(part in frame.filename for part in skip):
            return f"{frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno} ({frame.name})"
    return "?"


class HostSyncs(TorchDispatchMode):
    """While active: ``waits`` lists each host wait on the device (what, and who asked)."""

    def __init__(self):
        super().__init__()
        self.host = WeakIdKeyDictionary()
        self.waits: list[str] = []
        self._patched = {}

    def on_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.host

    def mark_host(self, tree) -> None:
        """The tensors of ``tree``, and the buffers they are views of, in host memory."""
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor):
                self.host[t] = True
                if t._base is not None:
                    self.host[t._base] = True

    def _wait(self, what: str) -> None:
        self.waits.append(f"{what} at {_where()}")

    @contextlib.contextmanager
    def paused(self):
        """Host work outside the step's device work (the data loader): neither followed nor
        counted."""
        with _disable_current_modes():
            saved, self._patched = self._patched, {}
            self._unpatch(saved)
            try:
                yield
            finally:
                self._patch()

    def step(self, train_step, data_iterator) -> list[str]:
        """Run ``train_step(batches)`` under this counter, the data loader outside it (host work)
        and its batches on the host, as TorchTitan's loader yields them; the step's waits."""
        seen = len(self.waits)

        def batches():
            while True:
                with self.paused():
                    batch = next(data_iterator)
                self.mark_host(batch)
                yield batch

        with self:
            train_step(batches())
        return self.waits[seen:]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter for t in tensors):
            # a DTensor (or another subclass): its own ops on local tensors come back here
            return NotImplemented
        if func in READS or func in SIZED_BY_VALUES:
            if not all(self.on_host(t) for t in tensors):
                self._wait(str(func))
        out = func(*args, **kwargs)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if self.on_host(dst) and not self.on_host(src) and not non_blocking:
                self._wait("a copy from the device")
            if not self.on_host(dst) and self.on_host(src):
                self._copy_to_device(src, non_blocking)
            return out  # the copy stays where it was made
        if func is aten._to_copy.default:
            to_host = (
                _host_device(kwargs["device"]) if "device" in kwargs else self.on_host(args[0])
            )
            non_blocking = kwargs.get("non_blocking", False)
            if to_host and not self.on_host(args[0]) and not non_blocking:
                self._wait("a copy from the device")
            if not to_host and self.on_host(args[0]):
                self._copy_to_device(args[0], non_blocking)
            on_host = to_host
        elif func is aten.lift_fresh.default:
            on_host = True  # a tensor made from Python values
        elif tensors:
            on_host = all(self.on_host(t) for t in tensors)
        else:
            on_host = _host_device(kwargs.get("device"))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if on_host:
                    self.host[t] = True
                else:
                    self.host.pop(t, None)
        return out

    def _copy_to_device(self, src: torch.Tensor, non_blocking: bool) -> None:
        # From a strided source ATen first makes a contiguous copy, in pageable memory.
        if not non_blocking:
            self._wait("a blocking copy to the device")
        elif not is_pinned(src) or not src.is_contiguous():
            self._wait("a copy to the device from pageable memory")

    # What dispatches no op on a CPU run, or loses its device on the way: reads of a CPU tensor's
    # own data, and a tensor made from Python values on the device (made on the host, then copied).
    def _python_level(self) -> dict:
        counter = self

        def read(name, original):
            def wrapped(t, *args, **kwargs):
                if type(t) is torch.Tensor and not counter.on_host(t):
                    if name != "to":
                        counter._wait(f"Tensor.{name}")
                    else:
                        device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
                        out = original(t, *args, **kwargs)
                        if (
                            out is t
                            and device is not None
                            and _host_device(device)
                            and not non_blocking
                        ):
                            counter._wait("Tensor.to (the host)")
                        return out
                return original(t, *args, **kwargs)

            return wrapped

        def made(name, original):
            def wrapped(*args, **kwargs):
                out = original(*args, **kwargs)
                if "device" in kwargs and not _host_device(kwargs["device"]):
                    counter._wait(f"torch.{name} on the device (a blocking copy to the device)")
                    counter.host.pop(out, None)
                return out

            return wrapped

        patches = {(torch.Tensor, name): read for name in ("tolist", "cpu", "numpy", "to")}
        patches.update({(torch, name): made for name in ("tensor", "as_tensor")})
        return {
            (owner, name): (getattr(owner, name), wrap(name, getattr(owner, name)))
            for (owner, name), wrap in patches.items()
        }

    def _patch(self):
        self._patched = self._python_level()
        for (owner, name), (_, wrapped) in self._patched.items():
            setattr(owner, name, wrapped)

    def _unpatch(self, patched):
        for (owner, name), (original, _) in patched.items():
            setattr(owner, name, original)

    def __enter__(self):
        self._patch()
        return super().__enter__()

    def __exit__(self, *exc):
        self._unpatch(self._patched)
        self._patched = {}
        return super().__exit__(*exc)
