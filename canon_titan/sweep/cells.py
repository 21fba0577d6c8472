"""A sweep's cells: one ordinary training run per (task, arm, seed), in a dump folder of its own
under ``[sweep] out``, with the command that trains it and the state it is in.

A cell's folder holds ``cell.json`` (its config and overrides: what it was trained with), the
run's own files (``run_config.toml``, ``checkpoint/``, ``tb/``), ``train.log``, the raw scores of
its evaluation and ``scores.json`` (those scores in the sweep's form). A cell whose scores are
there is reused; one trained to its steps is only scored; any other trains (resuming from its
newest checkpoint, as any run does) and is then scored.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from canon_titan.convert.dcp_io import step_dirs
from canon_titan.sweep.spec import Arm, Spec, SweepError, override_args
from canon_titan.tools.fileio import write_atomic

CELL_FILE = "cell.json"
SCORES_FILE = "scores.json"
SWEEP_FILE = "sweep.json"
"""Under a sweep's out folder: its cells (``canon-titan report`` reads it), beside ``spec.toml``, a
copy of the spec it ran."""


@dataclass(frozen=True)
class Task:
    """One base config of the sweep, named by what ran (``playground/depo``), not its preset."""

    config: str
    label: str
    description: str
    """The data in words: a synthetic task's preset and the parameters it changes, or the text."""


def task_label(config: str) -> str:
    """``train_configs/playground/depo.toml`` -> ``playground/depo``; another path -> its stem."""
    path = Path(config)
    parts = path.with_suffix("").parts
    return (
        "/".join(parts[parts.index("train_configs") + 1 :])
        if "train_configs" in parts[:-1]
        else path.stem
    )


@dataclass(frozen=True)
class Cell:
    task: Task
    arm: Arm
    seed: int
    steps: int
    folder: Path
    nproc: int
    overrides: tuple[str, ...]
    """Every ``--section.key=value`` of its training run but the dump folder and the steps."""

    @property
    def name(self) -> str:
        return f"{self.task.label} {self.arm.label} seed {self.seed}"

    def train_args(self) -> list[str]:
        """The overrides its training run gets, after ``--config``."""
        return [
            *self.overrides,
            *override_args([("training.steps", self.steps), ("job.dump_folder", str(self.folder))]),
        ]

    def train_command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "canon_titan.cli",
            "train",
            "--config",
            self.task.config,
            "--nproc",
            str(self.nproc),
            *self.train_args(),
        ]

    def record(self) -> dict:
        return {
            "config": self.task.config,
            "task": self.task.label,
            "arm": self.arm.label,
            "seed": self.seed,
            "nproc": self.nproc,
            "overrides": self.train_args(),
        }

    def check_folder(self) -> None:
        """A folder trained with other settings is not this cell: refuse it (nothing is removed)."""
        recorded = self.folder / CELL_FILE
        if not recorded.is_file():
            return
        try:
            previous = json.loads(recorded.read_text())
        except (OSError, ValueError) as e:
            raise SweepError(
                f"{recorded}: cannot be read ({e}); remove the cell's folder to train it again"
            ) from None
        mine = self.record()
        changed = [k for k in ("config", "nproc", "overrides") if previous.get(k) != mine[k]]
        if changed:
            before, after = previous.get(changed[0]), mine[changed[0]]
            if changed[0] == "overrides":
                before = sorted(set(before or []) - set(after))
                after = sorted(set(after) - set(previous.get("overrides") or []))
            raise SweepError(
                f"{self.folder} was trained as another cell ({changed[0]}: {before} there, {after} "
                "now): give the sweep another [sweep] out, or remove that folder"
            )

    def write_record(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomic(self.folder / CELL_FILE, json.dumps(self.record(), indent=2) + "\n")

    def trained_step(self) -> Path | None:
        return trained_step(self.folder, self.steps)


def trained_step(folder: Path, steps: int) -> Path | None:
    """The cell's complete checkpoint at ``steps`` or later (None: not trained that far)."""
    done = [path for step, path in step_dirs(Path(folder) / "checkpoint") if step >= steps]
    return done[-1] if done else None


def write_sweep_file(spec: Spec, cells: list[Cell]) -> None:
    cells_record = [
        {
            "folder": str(c.folder.resolve()),
            "task": c.task.label,
            "arm": c.arm.label,
            "seed": c.seed,
        }
        for c in cells
    ]
    write_atomic(spec.out / "spec.toml", spec.path.read_text())
    write_atomic(
        spec.out / SWEEP_FILE,
        json.dumps({"spec": str(spec.path), "cells": cells_record}, indent=2) + "\n",
    )
