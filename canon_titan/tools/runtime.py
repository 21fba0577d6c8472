"""Compatibility shims that let TorchTitan 0.3.0's real Trainer run on CPU (gloo) and torch 2.13.

Every shim is guarded by a feature check, never by a version string: on a CUDA machine with
torch >= 2.14 none of them applies. ``apply()`` must run before ``torchtitan.trainer`` is used; it
also rebinds names in already-imported torchtitan modules, so import order does not matter. Each
name patched here is pinned in ``tests/test_upstream.py`` with the upstream limitation it works
around (``docs/development.md`` lists them); the planner's own patches live in ``canon_titan/plan``.

Not shimmed on purpose: FlexAttention has no CPU backward, but canon-titan's attention calls
causal SDPA directly (as the reference does), so the trainer never builds flex masks for it.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
import types

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

_applied: list[str] = []
_force_cpu = False
"""Set by ``apply(cpu=True)``: the CPU shims apply even where an accelerator is present."""


def _accelerator() -> bool:
    """Whether this process trains on an accelerator (its shims for a CPU stay off)."""
    return not _force_cpu and torch._utils._get_available_device_type() is not None


class CpuDeviceModule:
    """The part of ``torch.cuda``'s surface that the trainer and metrics use, for CPU.

    TorchTitan falls back to ``device_type="cuda"`` when no accelerator is present and then calls
    ``torch.cuda.set_device``, which the CPU wheel lacks. Memory statistics are the process's
    peak resident set size since the last reset (Linux: ``VmHWM``, reset through
    ``/proc/self/clear_refs``), so the log's ``memory:`` is real memory on a CPU too.
    """

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def set_device(self, device) -> None:
        pass

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def synchronize(self, *args, **kwargs) -> None:
        pass

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def get_device_properties(self, device=None):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=total, name="cpu")

    def memory_stats(self, device=None) -> dict:
        peak = _peak_rss_bytes()
        if peak is None:
            return {}
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def reset_peak_memory_stats(self, *args, **kwargs) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
        except OSError:
            pass

    def empty_cache(self) -> None:
        pass


def _peak_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _quiet_cpu_log() -> None:
    """On a CPU, TorchTitan's notes about GPUs say nothing: no ``lspci`` and no peak-FLOPS figure
    (MFU is left out instead, see CanonMetrics), NCCL's error-handling variable (gloo is used), and
    DTensor's note that its random ops on a CPU mesh are less tested (the tests compare CPU runs
    exactly). Each is dropped at its source; everything else is kept."""
    import logging
    import warnings

    import torchtitan.tools.utils as tt_utils

    if _accelerator() or "quiet-cpu-log" in _applied:
        return
    original = tt_utils.get_peak_flops

    @functools.wraps(original)
    def get_peak_flops(device_name: str) -> float:
        return float("nan") if device_name == "cpu" else original(device_name)

    tt_utils.get_peak_flops = get_peak_flops
    noise = ("ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING]", "Peak FLOPS used for computing MFU")
    logging.getLogger().addFilter(lambda record: not record.getMessage().startswith(noise))
    warnings.filterwarnings(
        "ignore",
        message="DTensor (random operators|manual_seed\\(\\)) may not have complete "
        "support on cpu device mesh",
    )
    _applied.append("quiet-cpu-log")


def _use_cpu_device() -> None:
    import torchtitan.tools.utils as tt_utils

    if _accelerator() or "cpu-device" in _applied:
        return
    old_type, old_module = tt_utils.device_type, tt_utils.device_module
    cpu_module = CpuDeviceModule()
    # Modules such as components.metrics bind these names at import time.
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan"):
            continue
        if getattr(module, "device_module", None) is old_module:
            module.device_module = cpu_module
        if getattr(module, "device_type", None) == old_type:
            module.device_type = "cpu"
    _applied.append("cpu-device")


def _gloo_safe_fsdp_reduction() -> None:
    """Gloo has no ReduceOp.PREMUL_SUM, which FSDP2 uses once the divide factor is set to 1."""
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    if _accelerator():
        return
    original = tt_fsdp.disable_fsdp_gradient_division
    if getattr(original, "_canon_titan_shim", False):
        return

    @functools.wraps(original)
    def disable_division_with_sum_reduction(model):
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    disable_division_with_sum_reduction._canon_titan_shim = True
    tt_fsdp.disable_fsdp_gradient_division = disable_division_with_sum_reduction
    _applied.append("gloo-fsdp-sum-reduction")


def _gloo_safe_barrier() -> None:
    """Gloo's barrier rejects device ids; TorchTitan passes the current device's index."""
    if _accelerator():
        return
    original = dist.barrier
    if getattr(original, "_canon_titan_shim", False):
        return

    @functools.wraps(original)
    def barrier(*args, device_ids=None, **kwargs):
        if device_ids is not None and dist.get_backend(kwargs.get("group")) == "gloo":
            device_ids = None
        return original(*args, device_ids=device_ids, **kwargs)

    barrier._canon_titan_shim = True
    dist.barrier = barrier
    _applied.append("gloo-barrier")


def _set_timeout() -> None:
    """TorchTitan calls ``dist.set_timeout`` after step 1; older torch only has the private form."""
    if hasattr(dist, "set_timeout"):
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    def set_timeout(timeout, group=None):
        _set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout
    _applied.append("dist-set-timeout")


def _pipeline_step_with_microbatches() -> None:
    """TorchTitan passes pre-split microbatches (``arg_mbs=``) to ``schedule.step``.

    Schedules whose ``step`` predates that keyword get a wrapper that routes such calls to
    ``_step_microbatches`` after the per-iteration stage reset that ``step`` would do.
    """
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        original = cls.step
        if "arg_mbs" in inspect.signature(original).parameters:
            continue
        if getattr(original, "_canon_titan_shim", False):
            continue

        @functools.wraps(original)
        def step(
            self,
            *args,
            arg_mbs=None,
            kwarg_mbs=None,
            target_mbs=None,
            losses=None,
            return_outputs=True,
            loss_kwargs=None,
            _original=original,
            **kwargs,
        ):
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return _original(
                    self,
                    *args,
                    losses=losses,
                    return_outputs=return_outputs,
                    loss_kwargs=loss_kwargs,
                    **kwargs,
                )
            stages = getattr(self, "_stages", None) or [self._stage]
            for stage in stages:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(
                arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
            )
            return None

        step._canon_titan_shim = True
        cls.step = step
        _applied.append(f"pp-step-microbatches:{cls.__name__}")


END_OF_TRAINING_SLEEP = "Sleeping 2 seconds for other ranks to complete"


class _TimeWithoutSleep:
    """The ``time`` module as ``torchtitan.trainer`` sees it under ``end-barrier``: all of it but
    ``sleep``, which returns at once."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        return None


def _end_barrier_not_sleep() -> None:
    """TorchTitan's training loop ends with rank 0 sleeping 2 seconds "for other ranks to
    complete", on every run, one process too (every training run of the test suite pays it). Under
    this shim, on a CPU only (on a GPU cluster 2 s a run is nothing, and its runs patch no more of
    TorchTitan than they must), that sleep returns at once (and its log line is dropped), and every
    rank instead waits at a barrier until all have left the loop (``CanonTrainer.train``,
    ``end_barrier``): what the sleep stands for, no longer than the slowest rank takes. It applies
    only where ``time.sleep`` is called once in ``torchtitan.trainer``, in ``Trainer.train`` after
    that log line."""
    import logging

    import torchtitan.trainer as tt_trainer

    if (
        _accelerator()
        or "end-barrier" in _applied
        or isinstance(getattr(tt_trainer, "time", None), _TimeWithoutSleep)
    ):
        return
    try:
        module_source = inspect.getsource(tt_trainer)
        train_source = inspect.getsource(tt_trainer.Trainer.train)
    except (OSError, TypeError):
        return
    if (
        module_source.count("time.sleep(") != 1
        or END_OF_TRAINING_SLEEP not in train_source
        or "time.sleep(" not in train_source.split(END_OF_TRAINING_SLEEP, 1)[1]
    ):
        return
    tt_trainer.time = _TimeWithoutSleep()
    logging.getLogger().addFilter(lambda record: record.getMessage() != END_OF_TRAINING_SLEEP)
    _applied.append("end-barrier")


def end_barrier() -> None:
    """Where ``end-barrier`` applies: every rank waits here, at the end of its training loop, until
    all have reached it (nothing on one process, or without the shim)."""
    if "end-barrier" not in _applied or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def apply(*, cpu: bool = False) -> list[str]:
    """Apply every shim this machine needs; returns their names (also logged once). ``cpu``: the
    shims for a CPU apply even where an accelerator is present: the planner builds and steps every
    rank on fake CPU tensors, on a GPU machine too (TorchTitan would otherwise
    ``torch.cuda.set_device`` the CPU and fail with "Expected a cuda device, but got: cpu")."""
    global _force_cpu
    if _applied and not (cpu and not _force_cpu):
        return list(_applied)
    _force_cpu = _force_cpu or cpu
    if "none" in _applied:
        _applied.remove("none")
    _use_cpu_device()
    _quiet_cpu_log()
    _gloo_safe_fsdp_reduction()
    _gloo_safe_barrier()
    _set_timeout()
    _pipeline_step_with_microbatches()
    _end_barrier_not_sleep()
    if not _applied:
        _applied.append("none")
    logger.info(f"canon-titan runtime shims: {', '.join(_applied)}")
    return list(_applied)


def device_type() -> str:
    import torchtitan.tools.utils as tt_utils

    return tt_utils.device_type
