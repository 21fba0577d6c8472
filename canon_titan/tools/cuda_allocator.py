"""The CUDA caching allocator's mode of a training process: expandable segments
(``PYTORCH_ALLOC_CONF=expandable_segments:True``), as TorchTitan's ``run_train.sh`` sets and as the
GPU runs the planner is calibrated on used, unless the user's environment sets the allocator's
configuration itself. Set by the training process (``-m canon_titan.train``) before CUDA starts, so
every launch path has it; the planner's allocator model (``plan.allocator``) reads the same
environment to know which mode the run will use."""

from __future__ import annotations

import os
from collections.abc import Mapping

SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""The allocator's configuration, by its current name and its older one (torch reads either)."""
DEFAULT = "expandable_segments:True"


def use_expandable_segments() -> None:
    """Expandable segments for this process, unless the environment configures the allocator."""
    if not any(os.environ.get(name) for name in SETTINGS):
        os.environ[SETTINGS[0]] = DEFAULT


def expandable_segments(env: Mapping[str, str] = os.environ) -> bool:
    """Whether a training process started with ``env`` runs with expandable segments: the default,
    or what its ``PYTORCH_ALLOC_CONF`` (else ``PYTORCH_CUDA_ALLOC_CONF``) says (``key:value`` pairs
    separated by commas; torch's own parser lets a later pair win)."""
    conf = next((env[name] for name in SETTINGS if env.get(name)), DEFAULT)
    enabled = False
    for pair in conf.split(","):
        key, _, value = pair.partition(":")
        if key.strip() == "expandable_segments":
            enabled = value.strip() == "True"
    return enabled
