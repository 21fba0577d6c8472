"""TorchTitan's DCP checkpointer with the guarantees a long run needs: no checkpoint with
non-finite parameters is ever written (so ``keep_latest_k`` never purges the newest finite one:
every step it keeps is finite), a save can be forced between intervals (preemption), and any
failure of a save is one line naming the path, the error and the free space of its filesystem (a
full disk often shows as torch's writer's ``RuntimeError``, with no OSError at all), with the partial
step folder removed.

Kept light (no model or data imports): ``config validate`` builds this section's config."""

from __future__ import annotations

import errno
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtitan.components.checkpointer import CheckpointManager


class NonFiniteParameters(RuntimeError):
    pass


class SaveFailed(RuntimeError):
    pass


def newest_checkpoint_hint(folder: str | Path, before: int) -> str:
    """The newest intact checkpoint below step ``before`` and how to resume from it."""
    from canon_titan.convert.dcp_io import checkpoint_problem, step_dirs

    for step, path in step_dirs(folder):
        if step < before and checkpoint_problem(path) is None:
            return (f"the last good checkpoint is {path}; resume from it with --checkpoint.load_step {step} "
                    "(a lower learning rate, [divergence] spike_factor, or other data may avoid the divergence)")
    return "there is no earlier checkpoint: start again with a lower learning rate"


def newest_checkpoint_line(folder: str | Path) -> str:
    """What is on disk to resume from, in words: the newest complete step, or none yet."""
    from canon_titan.convert.dcp_io import step_dirs

    steps = step_dirs(folder)
    if not steps:
        return "there is no checkpoint yet: running the command again starts from the beginning"
    step, path = steps[0]
    return f"the newest complete checkpoint is step {step} ({path}): running the same command again resumes from it"


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError under a save failure (DCP wraps the writer's in its own exceptions)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            return exc
        failures = getattr(exc, "failures", None)  # DCP's CheckpointException: {rank: (exception, stack)}
        if isinstance(failures, dict):
            for inner in failures.values():
                inner = inner[0] if isinstance(inner, tuple) else inner
                found = _os_error(inner) if isinstance(inner, BaseException) else None
                if found:
                    return found
        exc = exc.__cause__ or exc.__context__
    return None


FULL_BELOW = 64 * 2**20
"""Free bytes under which a failed save's filesystem is called full (a full disk's save leaves
little more than the pieces that did not fit)."""


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    for folder in (path, *path.parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            continue
    return None


def save_failure(step: int, step_dir: Path, exc: BaseException) -> str:
    """The one line for a failed save: what failed, and how much room its filesystem has left."""
    error, free = _os_error(exc), free_bytes(step_dir)
    full = (error is not None and error.errno == errno.ENOSPC) or (free is not None and free < FULL_BELOW)
    if full:
        what = "the disk is full"
    elif error is not None:
        what = f"{error.strerror or error} ({error.filename or step_dir})"
    else:
        cause = _first_failure(exc)
        lines = str(cause).strip().splitlines()
        what = f"{type(cause).__name__}: {lines[0] if lines else ''}"
    room = f"{free / 2**20:,.1f} MiB free on its filesystem" if free is not None else "its filesystem cannot be read"
    return (f"saving checkpoint step {step} to {step_dir} failed: {what} ({room}); the partial folder is removed "
            "and earlier checkpoints are intact. Free space (or set [checkpoint] keep_latest_k) and run the same "
            "command to resume")


def _first_failure(exc: BaseException) -> BaseException:
    """The error under DCP's CheckpointException (which only lists the ranks that failed)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for _, inner in sorted(failures.items()):
            inner = inner[0] if isinstance(inner, tuple) else inner
            if isinstance(inner, BaseException):
                return _first_failure(inner)
    return exc


class CanonCheckpointer(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.force_next_save = False

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return (self.force_next_save and self.enable and not self.load_only) or super()._should_save(
            curr_step, last_step)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self._check_finite(curr_step)
        step_dir = Path(self._create_checkpoint_id(curr_step))
        try:
            return super()._save(curr_step, last_step)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            message = save_failure(curr_step, step_dir, e)  # the free space before the partial folder goes
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                shutil.rmtree(step_dir, ignore_errors=True)
            raise SaveFailed(message) from None
        finally:
            self.force_next_save = False

    def _check_finite(self, step: int) -> None:
        """Every rank's parameters finite, agreed across ranks, before any of them writes."""
        params = [p.to_local() if hasattr(p, "to_local") else p
                  for part in self.states["model"].model for p in part.parameters()]
        bad = torch.zeros(1, device=params[0].device if params else "cpu")
        if params:
            # One fused max-abs over every parameter (NaN and inf carry through it; a large finite value
            # stays finite, as it would not in a 2-norm), and one host sync below, not one per parameter.
            largest = torch.nn.utils.get_total_norm(params, norm_type=math.inf)
            bad += largest.isfinite().logical_not().float()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad)
        if bad.item():
            raise NonFiniteParameters(f"the parameters at step {step} are not finite (NaN or inf), so its "
                                      f"checkpoint is not written; {newest_checkpoint_hint(self.folder, step)}")
