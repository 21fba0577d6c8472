"""Sequence-mixing kernels (the Canon op, GLA, gated delta rule, Mamba2 SSD), each with a
pure-PyTorch backend and a Triton one."""

from canon_titan.kernels.backends import resolve_backend
from canon_titan.kernels.delta_rule import gated_delta_rule
from canon_titan.kernels.gla import gla
from canon_titan.kernels.ssd import ssd

__all__ = ["gated_delta_rule", "gla", "resolve_backend", "ssd"]
