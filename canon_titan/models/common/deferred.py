"""Modules imported when first used.

Reading and checking a config (``config validate``, the pre-launch checks) needs a family's args
but not its modules. The model stack costs most of a command's start-up:
``torchtitan.models.common`` compiles FlexAttention as it is imported, which loads dynamo and
inductor (most of that start-up: docs/benchmarks/cpu.md). The args modules reach the model
classes they build configs from through ``deferred(...)``, and modules the checks read constants
from reach their heavy dependencies so, which puts that cost on the first build, not on import.
"""

from __future__ import annotations

import importlib


class Deferred:
    """Stands for the module ``name``; the first attribute read imports it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<deferred module {self._name!r}>"


def deferred(name: str) -> Deferred:
    return Deferred(name)
