"""What a canon-titan process spends on starting and ending, spared where nothing is lost: the
cyclic garbage collector kept out of the imports of torch, TorchTitan and their dependencies
(``importing``), and out of the interpreter's last collections (``freeze_at_exit``); and the
process-wide settings of a canon-titan program (``process_setup``), which its entry points make
and importing the package never does. What each saves: docs/benchmarks/cpu.md, "Start-up and exit".
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import re
import sys


@contextlib.contextmanager
def importing():
    """Imports without the cyclic collector: the millions of objects that importing TorchTitan
    creates nearly all live until the process ends, so each collection meanwhile walks a growing
    heap and frees next to nothing. Afterwards the collector is as it was before. (Nothing is frozen
    here: a process that imports a command in the middle of other work, as the tests do, would keep
    its garbage.)"""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_at_exit() -> None:
    """At exit, move every object the collector tracks to its permanent generation, so that the
    interpreter's last collections skip them. Objects freed by reference counting are still
    destructed, and exit handlers still run (this one, registered as the program starts, runs after
    those registered later); only reference cycles left at exit stay uncollected, which CPython does
    not promise to collect at exit anyway."""
    atexit.register(gc.freeze)


_set_up: list[bool] = []


def process_setup() -> None:
    """What a canon-titan program (``canon-titan``, ``-m canon_titan.train``, ``-m
    canon_titan.launch.torchrun``) sets for its whole process, first thing, before torch is
    imported: the collector frozen at exit, and three messages dropped that every import of
    TorchTitan prints and that tell a user nothing: torchao trying to load its CUDA-only kernel
    libraries (``Failed to load ..._C_mxfp8...so``) on a machine without them, torch's notice that
    torchao still registers enums with pytree (torchao's code, not ours), and DTensor's note that a
    gradient norm over FSDP x TP (``_NormPartial`` on two mesh dimensions) is reduced by two
    all-reduces of one scalar each, which costs nothing worth a line in the middle of a plan's
    table or a training log. Everything else from these loggers still shows. The messages are
    pinned in ``tests/test_upstream.py``. A program that imports canon-titan as a library keeps its
    own settings."""
    if _set_up:
        return
    _set_up.append(True)
    freeze_at_exit()
    for name, pattern in NOISE.items():
        logging.getLogger(name).addFilter(
            lambda record, pattern=pattern: not re.search(pattern, record.getMessage())
        )


NOISE = {
    "torchao": r"^Failed to load ",
    "torch.utils._pytree": r"is an Enum subclass and is now natively supported",
    "torch.distributed.tensor._redistribute": r"^While redistributing from \(_NormPartial",
}
"""Logger -> the message (a regular expression) it prints that ``process_setup`` drops."""


class _CurrentStdout:
    """``sys.stdout`` as it is when a record is written, not when logging was set up."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


def init_logging() -> None:
    """TorchTitan's log format on stdout. A command may run more than once in one process (a
    notebook, the tests) with stdout replaced in between; the handler writes to the current one."""
    from torchtitan.tools.logging import init_logger

    init_logger()
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(_CurrentStdout())
