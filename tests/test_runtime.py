"""The CPU/torch-2.13 shims: applied only where the feature is missing."""

import inspect

import torch
import torch.distributed as dist

from canon_titan.tools import runtime


def test_shims_match_this_machine():
    applied = runtime.apply()
    import torchtitan.components.metrics as metrics
    import torchtitan.tools.utils as tt_utils

    no_accelerator = torch._utils._get_available_device_type() is None
    assert ("cpu-device" in applied) == no_accelerator
    if no_accelerator:
        # Names bound at import time in other torchtitan modules were rebound too.
        assert tt_utils.device_type == metrics.device_type == "cpu"
        assert metrics.device_module.get_device_name() == "cpu"
    assert hasattr(dist, "set_timeout")
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        assert "arg_mbs" in inspect.signature(cls.step).parameters or getattr(cls.step, "_canon_titan_shim", False)
    assert runtime.apply() == applied  # idempotent
