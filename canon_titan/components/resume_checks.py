"""Whether a checkpoint can continue this run, checked from its ``.metadata`` and small saved
values before any rank loads it (the launcher before torchrun starts, then the trainer's rank 0,
whose verdict every rank takes): the model's tensors, the data it was trained on, the data
loader's layout and the global batch."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from canon_titan.convert.dcp_io import model_mismatch, model_only, read_metadata
from canon_titan.data.fingerprint import FINGERPRINT_KEY, fingerprint_changes

GLOBAL_BATCH_KEY = "train_state.global_batch_size"


class ResumeRefused(RuntimeError):
    pass


@dataclass
class ResumeVerdict:
    warnings: list[str] = field(default_factory=list)
    new_data_pass: bool = False
    """The data changed and [dataloader] allow_changed_data says go on: the loader starts afresh."""


def saved_loader_keys(step_dir: str | Path) -> list[str]:
    """The data loader's entries in a DCP checkpoint (names below ``dataloader.``)."""
    prefix = "dataloader."
    return sorted(
        k[len(prefix) :]
        for k in read_metadata(Path(step_dir)).state_dict_metadata
        if k.startswith(prefix)
    )


def saved_value(step_dir: str | Path, key: str):
    """A non-tensor value a checkpoint holds under ``key``, or None when it has none."""
    import torch.distributed.checkpoint as dcp

    if key not in read_metadata(Path(step_dir)).state_dict_metadata:
        return None
    state = {key: None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: loading in a single process"
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return state[key]


def loads_model_only(step_dir: str | Path) -> bool:
    """TorchTitan loads the model alone from this checkpoint: a model-only save, or a step-0 (seed)
    checkpoint, which ``create_seed_checkpoint`` writes with a train state that a run starting from
    it does not load."""
    return Path(step_dir).name == "step-0" or model_only(Path(step_dir))


def layout_problem(step_dir: str | Path, keys: list[str], dp_size: int) -> str | None:
    """Why a checkpoint's loader state cannot resume at ``dp_size`` data-parallel ranks, or None.
    The packed loaders keep one global position and the synthetic one every rank's carries, so
    they resume at any size; the streaming loader keeps per-rank readers, buffers and shuffle
    state (TorchTitan's ``dp_rank_N`` entries), which cannot be split another way."""
    ranks = [k for k in keys if re.fullmatch(r"dp_rank_\d+", k)]
    if not ranks or len(ranks) == dp_size:
        return None
    return (
        f"checkpoint {step_dir} was written by a run streaming its data ([dataloader] "
        "dataset = 'stream') on "
        f"{len(ranks)} data-parallel rank(s); this run has {dp_size}. Each rank's stream "
        "position (its "
        "share of the files, buffer and shuffle state) cannot be re-split: resume with "
        f"{len(ranks)} "
        "data-parallel rank(s), or train from a token folder (canon-titan data tokenize, "
        "dataset = 'tokens'), "
        "whose runs resume at any data-parallel size"
    )


def check_resume(
    step_dir: str | Path,
    *,
    shapes: dict[str, torch.Size],
    model: str,
    fingerprint: str,
    allow_changed_data: bool,
    dp_size: int,
    global_batch: int,
    batch_explicit: bool,
) -> ResumeVerdict:
    """Raise ResumeRefused naming the first reason ``step_dir`` cannot continue this run; else the
    warnings to show and whether the loader starts a new pass."""
    step_dir = Path(step_dir)
    problem = model_mismatch(step_dir, shapes, model)
    if problem:
        raise ResumeRefused(
            f"{problem}. The checkpoint was written by another model (shape or family): resume "
            "with the model it was trained with, or use another [job] dump_folder for this one"
        )
    verdict = ResumeVerdict()
    if loads_model_only(step_dir):
        return verdict  # nothing else of it is loaded, so nothing else of it has to match
    keys = saved_loader_keys(step_dir)
    saved_data = saved_value(step_dir, f"dataloader.{FINGERPRINT_KEY}")
    changes = (
        fingerprint_changes(saved_data, fingerprint)
        if saved_data is not None and fingerprint
        else ""
    )
    if changes and not allow_changed_data:
        raise ResumeRefused(
            f"the data differs from the one checkpoint {step_dir} was trained on: {changes}. Its "
            "data loader position would select other windows, repeating some and skipping others. "
            "Restore the data to resume, or pass --dataloader.allow_changed_data true to start a "
            "new pass over the new data on purpose"
        )
    if changes:
        verdict.new_data_pass = True
        verdict.warnings.append(
            f"the data differs from the checkpoint's ({changes}); [dataloader] "
            "allow_changed_data: the data loader starts a new pass over the new data"
        )
    else:
        problem = layout_problem(step_dir, keys, dp_size)
        if problem:
            raise ResumeRefused(problem)
    saved_batch = saved_value(step_dir, GLOBAL_BATCH_KEY)
    if saved_batch is not None and saved_batch != global_batch:
        change = f"the global batch changes from {saved_batch} to {global_batch} sequences"
        if not batch_explicit:
            raise ResumeRefused(
                f"{change}: [training] global_batch_size = -1 takes local_batch_size x the "
                f"data-parallel ranks, and those changed since checkpoint {step_dir}. Pass "
                f"--training.global_batch_size {saved_batch} to keep the recipe (gradient "
                f"accumulation makes up the difference), or --training.global_batch_size "
                f"{global_batch} to change it on purpose"
            )
        verdict.warnings.append(
            f"{change} ([training] global_batch_size) since checkpoint {step_dir}"
        )
    return verdict
