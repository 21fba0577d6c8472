"""TorchTitan's DCP checkpointer with the guarantees a long run needs:

- no checkpoint with non-finite weights or optimizer state is written (so ``keep_latest_k`` never
  purges the newest finite one), and none is loaded: what a load restores is checked (one fused
  max-abs over weights and optimizer state, one host sync), and a checkpoint whose bytes do not load
  or whose values are not finite is named and the run falls back to the newest complete checkpoint
  before it;
- a checkpoint is called good only when this process checked it (it saved or loaded it);
- a save can be forced between intervals (preemption), and with ``purge_before_save`` the oldest
  checkpoints go before a save rather than after it (TorchTitan's ``keep_latest_k`` deletes only
  after a save succeeds, so a full disk stays full);
- any failure of a save is one line naming the path, the error and the free space of its filesystem
  (a full disk often shows as torch's writer's ``RuntimeError``, with no OSError at all), with the
  partial step folder removed and, for a full disk, the room a checkpoint needs and the settings
  that make it fit.

Kept light (no model or data imports): ``config validate`` builds this section's config."""

from __future__ import annotations

import errno
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed.checkpoint as dcp
import tyro
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.tools.logging import logger

from canon_titan.components.resume_checks import GLOBAL_BATCH_KEY
from canon_titan.convert.dcp_io import (
    CheckpointDamaged,
    FileNamingReader,
    NoLoadableCheckpoint,
    checkpoint_problem,
    inner_failure,
    model_only,
    step_dirs,
)
from canon_titan.tools.collectives import rank_zero_decides


class NonFiniteParameters(RuntimeError):
    pass


class SaveFailed(RuntimeError):
    pass


_refusals: list[str] = []


def refuse_saves(reason: str) -> None:
    """From now on this process's next save stops the run (``SaveFailed(reason)``) instead of
    writing: another run has taken the dump folder (``launch/ownership.py``). Any thread may call
    it."""
    _refusals.append(reason)


def _rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def newest_checkpoint_hint(
    folder: str | Path,
    before: int,
    checked: set[int] = frozenset(),
    damaged: set[int] = frozenset(),
) -> str:
    """The newest intact checkpoint below step ``before`` and how to resume from it. Only one of
    ``checked`` (saved or loaded by this process, its values finite) is called good."""
    for step, path in step_dirs(folder):
        if step < before and step not in damaged and checkpoint_problem(path) is None:
            resume = (
                f"resume from it with --checkpoint.load_step {step} (a lower learning "
                "rate, [divergence] "
                "spike_factor, or other data may avoid the divergence)"
            )
            if step in checked:
                return f"the last good checkpoint is {path}; {resume}"
            return (
                f"the newest checkpoint before it is {path}, which this run neither saved "
                "nor loaded (a resume "
                f"checks its values as it loads it); {resume}"
            )
    return "there is no earlier checkpoint: start again with a lower learning rate"


def newest_checkpoint_line(folder: str | Path) -> str:
    """What is on disk to resume from, in words: the newest complete step, or none yet."""
    steps = step_dirs(folder)
    if not steps:
        return "there is no checkpoint yet: running the command again starts from the beginning"
    step, path = steps[0]
    return (
        f"the newest complete checkpoint is step {step} ({path}): running the same command "
        "again resumes from it"
    )


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


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _room_advice(step_dir: Path, free: int, keep_latest_k: int, purge_before_save: bool) -> str:
    """What makes the next save fit, from the size of the checkpoints already there: the space to
    free, and how many checkpoints the filesystem holds when the old ones go before each save."""
    complete = step_dirs(step_dir.parent)
    sizes = [folder_bytes(path) for _, path in complete]
    if not sizes:
        return "Free space there and run the same command to resume"
    size = max(sizes)
    # The room the partial folder took is free again once it is removed.
    partial = folder_bytes(step_dir) if step_dir.is_dir() else 0
    available = free + partial
    fits = (available + sum(sizes)) // size
    advice = (
        f"A checkpoint of this run takes {size / 2**20:,.1f} MiB: free at least "
        f"{max(size - available, 0) / 2**20:,.1f} MiB there"
    )
    keep = min(fits, keep_latest_k) if keep_latest_k else fits
    if fits >= 2 and not (purge_before_save and keep == keep_latest_k):
        advice += (
            f", or keep at most {keep} checkpoints and delete the oldest before each save "
            f"(--checkpoint.keep_latest_k {keep} --checkpoint.purge_before_save true; "
            "keep_latest_k alone "
            "deletes only after a save succeeds, which a full disk never lets happen)"
        )
    return advice + ", and run the same command to resume"


def save_failure(
    step: int,
    step_dir: Path,
    exc: BaseException,
    *,
    keep_latest_k: int = 0,
    purge_before_save: bool = False,
) -> str:
    """The one line for a failed save: what failed, how much room its filesystem has left, and for
    a full disk what makes the next save fit."""
    error, free = inner_failure(exc, OSError), free_bytes(step_dir)
    full = (error is not None and error.errno == errno.ENOSPC) or (
        free is not None and free < FULL_BELOW
    )
    if full:
        what = "the disk is full"
    elif error is not None:
        what = f"{error.strerror or error} ({error.filename or step_dir})"
    else:
        cause = _first_failure(exc)
        lines = str(cause).strip().splitlines()
        what = f"{type(cause).__name__}: {lines[0] if lines else ''}"
    room = (
        f"{free / 2**20:,.1f} MiB free on its filesystem"
        if free is not None
        else "its filesystem cannot be read"
    )
    advice = (
        _room_advice(step_dir, free, keep_latest_k, purge_before_save)
        if full and free is not None
        else "Run the same command to resume once that is fixed"
    )
    return (
        f"saving checkpoint step {step} to {step_dir} failed: {what} ({room}); the partial "
        "folder is removed "
        f"and earlier checkpoints are intact. {advice}"
    )


def _first_failure(exc: BaseException) -> BaseException:
    """The error under DCP's CheckpointException (which only lists the ranks that failed)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for _, inner in sorted(failures.items()):
            inner = inner[0] if isinstance(inner, tuple) else inner
            if isinstance(inner, BaseException):
                return _first_failure(inner)
    return exc


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def largest_magnitude(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The largest |value| over all ``tensors`` as one tensor on their device, by one fused max-abs
    (NaN and inf carry through it; a large finite value stays finite, as it would not in a 2-norm):
    no host sync."""
    return torch.nn.utils.get_total_norm(tensors, norm_type=math.inf)


class _EarlierTrainState(DefaultLoadPlanner):
    """DCP's load planner, which also loads a checkpoint saved before the trainer's state held the
    global batch (``CanonTrainer.state_dict``): that entry keeps its value instead of being refused
    as missing. Every other missing entry is refused as before."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is not None and GLOBAL_BATCH_KEY not in metadata.state_dict_metadata:
            self.state_dict.pop(GLOBAL_BATCH_KEY, None)


class CanonCheckpointer(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        purge_before_save: bool = False
        """With keep_latest_k: delete the oldest checkpoints down to keep_latest_k - 1 before each
        save, instead of down to keep_latest_k after it, so the disk never holds more than
        keep_latest_k (a save that fails leaves keep_latest_k - 1)."""
        precompute_float8_scales: Annotated[bool, tyro.conf.Suppress] = False
        """``[float8] precompute_float8_dynamic_scale_for_fsdp``: after the load that starts
        training (TorchTitan's ``train`` always calls ``load``, which restores a checkpoint or
        returns at once), the float8 weights' scales for the first forward's all-gather; without
        them torchao takes each rank's amax over the FSDP mesh alone, a TP shard's under TP."""

    def __init__(self, config: Config, *args, model_parts: list[nn.Module], **kwargs):
        self.checked: set[int] = set()
        """Steps whose checkpoint this process saved or loaded with finite weights and optimizer
        state."""
        self.damaged: set[int] = set()
        self.before_fallback: Callable[[Path], None] | None = None
        """Called with the step folder a load falls back to, before it loads (the trainer's resume
        checks)."""
        self.pinned_step: int | None = None
        """The step ``[checkpoint] load_step`` asks for: a damaged one is refused, not fallen back
        from."""
        self.model_parts = model_parts
        self.precompute_float8_scales = config.precompute_float8_scales
        super().__init__(config, *args, model_parts=model_parts, **kwargs)
        self.force_next_save = False
        self.purge_before_save = config.purge_before_save

    def load(self, step: int = -1) -> bool:
        """TorchTitan's load (nothing when checkpointing is off), then the float8 scales."""
        loaded = super().load(step)
        if self.precompute_float8_scales:
            from canon_titan.components.float8 import precompute_float8_scales

            precompute_float8_scales(self.model_parts)
        return loaded

    def resume_hint(self, before: int) -> str:
        """The newest checkpoint before step ``before`` to resume from, called good only if
        checked."""
        if not self.enable:
            return (
                "checkpointing is off ([checkpoint] enable = false): start again with a lower "
                "learning rate"
            )
        return newest_checkpoint_hint(self.folder, before, self.checked, self.damaged)

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return (
            self.force_next_save and self.enable and not self.load_only
        ) or super()._should_save(curr_step, last_step)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        if _refusals:
            raise SaveFailed(_refusals[0])
        self._check_finite(curr_step)
        step_dir = Path(self._create_checkpoint_id(curr_step))
        self._clear_for_save(curr_step, step_dir)
        try:
            saved = super()._save(curr_step, last_step)
        except (KeyboardInterrupt, SystemExit):
            raise
        # DCP's CheckpointException is a BaseException, raised on every rank
        except BaseException as e:

            def failure(error: BaseException = e) -> str:  # free space first; every rank says it
                message = save_failure(
                    curr_step,
                    step_dir,
                    error,
                    keep_latest_k=self.keep_latest_k,
                    purge_before_save=self.purge_before_save,
                )
                shutil.rmtree(step_dir, ignore_errors=True)
                return message

            raise SaveFailed(rank_zero_decides(failure, "the save failure")) from None
        finally:
            self.force_next_save = False
        self.checked.add(curr_step)
        self.damaged.discard(curr_step)
        return saved

    def _clear_for_save(self, step: int, step_dir: Path) -> None:
        """Before a save, on rank 0 while the others wait: the folder of a damaged checkpoint of the
        same step that the run fell back past goes (its stale files must not mix with the new ones),
        and with ``purge_before_save`` the oldest checkpoints beyond keep_latest_k - 1."""
        purge = self.purge_before_save and self.keep_latest_k > 0
        if step not in self.damaged and not purge:
            return
        if _rank0():
            if step in self.damaged:
                logger.warning(f"removing the damaged {step_dir} before saving step {step} again")
                shutil.rmtree(step_dir, ignore_errors=True)
            folder = Path(self.folder)
            older = sorted(
                int(m.group(1))
                for p in (folder.iterdir() if purge and folder.is_dir() else ())
                if (m := re.fullmatch(r"step-(\d+)", p.name)) and int(m.group(1)) < step
            )
            for old in older[: max(0, len(older) - (self.keep_latest_k - 1))]:
                logger.info(
                    f"deleting {folder / f'step-{old}'} before the save of step {step} "
                    "([checkpoint] purge_before_save)"
                )
                shutil.rmtree(folder / f"step-{old}", ignore_errors=True)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def _trained_tensors(self, optimizer: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's shards of the weights, and of the optimizer state when ``optimizer``."""
        params = [_local(p) for part in self.states["model"].model for p in part.parameters()]
        states = (
            [
                _local(v)
                for opt in self.states["optimizer"]
                for state in opt.state.values()
                for v in state.values()
                if torch.is_tensor(v) and v.is_floating_point()
            ]
            if optimizer
            else []
        )
        return params, states

    def _nonfinite(self, optimizer: bool) -> str:
        """What holds a NaN or inf on some rank, "parameters" or "optimizer state" ("" when
        nothing): one fused max-abs and one all-reduce (one host sync); only when one is found, a
        second pass over the parameters says which."""
        params, states = self._trained_tensors(optimizer)

        def any_rank_nonfinite(tensors: list[torch.Tensor]) -> bool:
            device = params[0].device if params else torch.device("cpu")
            bad = largest_magnitude(tensors).to(device).isfinite().logical_not().float().reshape(1)
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(bad)
            return bool(bad.item())

        if not any_rank_nonfinite(params + states):
            return ""
        return "parameters" if any_rank_nonfinite(params) else "optimizer state"

    def _check_finite(self, step: int) -> None:
        """Every rank's parameters and optimizer state finite, agreed across ranks, before any of
        them writes."""
        what = self._nonfinite(optimizer=True)
        if what:
            raise NonFiniteParameters(
                f"the {what} at step {step} {'is' if what == 'optimizer state' else 'are'} not "
                f"finite (NaN or inf), so its checkpoint is not written; "
                f"{self.resume_hint(step)}"
            )

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized) -> None:
        """TorchTitan's load, naming the file whose bytes do not load, then the values checked
        finite."""
        try:
            if from_hf:
                super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            else:
                dcp.load(
                    state_dict,
                    checkpoint_id=checkpoint_id,
                    planner=_EarlierTrainState(),
                    storage_reader=FileNamingReader(checkpoint_id),
                )
                self.states["model"].load_state_dict(state_dict)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            damaged = inner_failure(e, CheckpointDamaged)
            if damaged is None:
                raise
            raise CheckpointDamaged(
                f"checkpoint {checkpoint_id} cannot be loaded: {damaged}"
            ) from None
        what = self._nonfinite(optimizer="optimizer" in state_dict)
        if what:
            raise CheckpointDamaged(
                f"checkpoint {checkpoint_id} holds values that are not finite (NaN or inf) "
                f"in its {what}"
            )

    def _load(self, step: int = -1) -> bool:
        """TorchTitan's load; a checkpoint of this run's folder that is damaged (``dcp_load``) is
        named, and the run falls back to the newest complete checkpoint before it, or is refused in
        one line."""
        target = self._find_load_step() if step == -1 else step
        try:
            loaded = super()._load(step)
        except CheckpointDamaged as e:
            if target == -1:  # [checkpoint] initial_load_path: nothing of this run to fall back to
                raise NoLoadableCheckpoint(f"[checkpoint] initial_load_path: {e}") from None
            self.damaged.add(target)
            previous = self._previous_full(target)
            if target == self.pinned_step:
                before = (
                    f"; the newest complete checkpoint before it is step {previous}: "
                    "--checkpoint.load_step "
                    f"{previous}"
                    if previous is not None
                    else "; there is no complete checkpoint before it"
                )
                raise NoLoadableCheckpoint(
                    f"[checkpoint] load_step = {target}: {e}{before}"
                ) from None
            if previous is None:
                raise NoLoadableCheckpoint(
                    f"{e}, and there is no complete checkpoint before step {target} to fall "
                    f"back to (move {self._create_checkpoint_id(target)} away to start "
                    "afresh)"
                ) from None
            logger.warning(
                f"{e}: resuming from step {previous} instead, the newest complete "
                "checkpoint before it"
            )
            if self.before_fallback is not None:
                self.before_fallback(Path(self._create_checkpoint_id(previous)))
            return self._load(previous)
        if loaded and target >= 0:
            self.checked.add(target)
        return loaded

    def _previous_full(self, step: int) -> int | None:
        """The newest intact checkpoint below ``step`` that continues training (not weights alone: a
        weights-only load would keep whatever a failed load left in the optimizer state)."""
        for previous, path in step_dirs(self.folder):
            if previous < step and checkpoint_problem(path) is None and not model_only(path):
                return previous
        return None
