"""TorchTitan's optimizers with the divergence guard's verdict applied in their step.

The trainer judges each step on the device (``components/divergence.py``) and hands the step's
skip flag to ``GuardedOptimizers.skip_if`` before TorchTitan's train step calls ``step``. A
skipped update is not applied at all (AdamW moves the weights even on zero gradients): the fused
optimizers take the flag as their ``found_inf``, as ``torch.amp.GradScaler`` gives it, and skip
the update in their kernel with no host sync; the others cannot, so their step reads the flag on
the host (one sync) and does not call them.

Kept light (no model or data imports): ``config validate`` builds this section's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
import tyro
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer


class GuardedOptimizers(OptimizersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        precompute_float8_scales: Annotated[bool, tyro.conf.Suppress] = False
        """``[float8] precompute_float8_dynamic_scale_for_fsdp``: after each update, the float8
        weights' scales for FSDP's next float8 all-gather (``components/float8.py``)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]):
        super().__init__(config, model_parts=model_parts)
        self.precompute_float8_scales = config.precompute_float8_scales
        self._skip_flag: torch.Tensor | None = None

    @property
    def skips_on_device(self) -> bool:
        """Whether every optimizer skips a flagged update in its kernel (the fused ones)."""
        groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]
        return all(group.get("fused") for group in groups)

    def skip_if(self, flag: torch.Tensor) -> None:
        """The next ``step`` applies no update where ``flag`` (a 0-dim device tensor) holds 1."""
        self._skip_flag = flag

    def step(self, closure=None) -> None:
        flag, self._skip_flag = self._skip_flag, None
        if flag is not None and not self.skips_on_device:
            if bool(flag):  # read on the host (a sync): these optimizers cannot take the flag
                return None
            flag = None
        for optimizer in self.optimizers:
            optimizer.found_inf = flag
        try:
            super().step(closure)
        finally:
            for optimizer in self.optimizers:
                del optimizer.found_inf
        if self.precompute_float8_scales:
            from canon_titan.components.float8 import precompute_float8_scales

            precompute_float8_scales(self.model_parts)
        return None
