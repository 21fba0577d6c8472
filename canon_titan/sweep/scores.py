"""How a cell is scored, behind one small interface: the command that scores a trained cell (run
here or in its SLURM array task) and how its output becomes the sweep's ``scores.json``: per group,
a value and, where there are test items, each item's 1 or 0.

* ``synthetic``: the task's held-out test set (``canon-titan eval synthetic``), accuracy per group.
* ``lm``: lm-eval tasks (``canon-titan eval lm``), each task's accuracy out of its items.
* ``loss``: the run's last logged training loss (lower is better). A text run's validation loss is
  the evaluation it stands in for: it comes with ``[validation]`` (issue 85), and then is read here.
"""

from __future__ import annotations

import json
import sys
from abc import ABC, abstractmethod
from pathlib import Path

from canon_titan.sweep.cells import SCORES_FILE
from canon_titan.sweep.spec import Spec, SweepError
from canon_titan.tools.fileio import write_atomic

ALL = "all"
"""The group of every test item together."""


class Evaluation(ABC):
    kind: str
    metric: str
    higher_is_better = True
    percent = True
    """Values are fractions, shown in percent ("points" of difference)."""

    @abstractmethod
    def settings(self) -> dict:
        """What the scores depend on besides the weights: scores made otherwise are made again."""

    @abstractmethod
    def command(self, folder: Path, step_dir: Path) -> list[str] | None:
        """The scoring command of the cell trained in ``folder``, writing ``raw(folder)`` (None:
        nothing to run)."""

    @abstractmethod
    def raw(self, folder: Path) -> Path: ...

    @abstractmethod
    def groups(self, folder: Path) -> dict[str, dict]:
        """From the cell's raw output: group -> {"value"} (and, with items, "correct", "total" and
        "scores", each item's 1 or 0)."""

    def test_set(self, folder: Path) -> str | None:
        return None

    def write_scores(self, folder: Path, train_seconds: float | None) -> dict:
        record = {
            "eval": self.settings(),
            "groups": self.groups(folder),
            "test_set": self.test_set(folder),
            "train_seconds": train_seconds,
        }
        write_atomic(folder / SCORES_FILE, json.dumps(record) + "\n")
        return record

    def read_scores(self, folder: Path) -> dict | None:
        """The cell's scores when they are this evaluation's (None: score it)."""
        try:
            record = json.loads((folder / SCORES_FILE).read_text())
        except (OSError, ValueError):
            return None
        return record if record.get("eval") == self.settings() else None


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "canon_titan.cli", *args]


def _items(correct: int, total: int, scores: list[int] | None = None) -> dict:
    return {
        "value": correct / total,
        "correct": correct,
        "total": total,
        **({"scores": scores} if scores is not None else {}),
    }


class SyntheticEval(Evaluation):
    kind, metric = "synthetic", "accuracy"

    def __init__(self, count: int):
        self.count = count

    def settings(self):
        return {"kind": self.kind, "count": self.count}

    def raw(self, folder):
        return folder / "eval_synthetic.json"

    def command(self, folder, step_dir):
        return _cli(
            "eval",
            "synthetic",
            "--config",
            str(folder / "run_config.toml"),
            "--checkpoint",
            str(step_dir),
            "--count",
            str(self.count),
            "--out",
            str(self.raw(folder)),
        )

    def test_set(self, folder):
        return json.loads(self.raw(folder).read_text()).get("test_set")

    def groups(self, folder):
        result = json.loads(self.raw(folder).read_text())
        groups = {
            name: _items(g["correct"], g["total"], g["scores"])
            for name, g in result["groups"].items()
        }
        groups[ALL] = _items(
            result["overall"]["correct"],
            result["overall"]["total"],
            [s for g in result["groups"].values() for s in g["scores"]],
        )
        return groups


LM_METRICS = ("acc", "exact_match", "acc_norm")
"""The metric a task's group shows: the first of these it reports."""


class LmEval(Evaluation):
    kind, metric = "lm", "accuracy"

    def __init__(self, tasks: list[str], limit: float | None):
        self.tasks, self.limit = tasks, limit

    def settings(self):
        return {"kind": self.kind, "tasks": self.tasks, "limit": self.limit}

    def raw(self, folder):
        return folder / "eval_lm.json"

    def command(self, folder, step_dir):
        limit = [] if self.limit is None else ["--limit", str(self.limit)]
        return _cli(
            "eval",
            "lm",
            "--model",
            str(step_dir),
            "--config",
            str(folder / "run_config.toml"),
            "--suite",
            *self.tasks,
            "--dtype",
            "fp32",
            *limit,
            "--out",
            str(self.raw(folder)),
        )

    def groups(self, folder):
        record = json.loads(self.raw(folder).read_text())
        groups = {}
        for task, metrics in record["results"].items():
            metric = next((m for m in LM_METRICS if f"{m},none" in metrics), None)
            samples = record.get("n-samples", {}).get(task, {}).get("effective")
            if metric is None or not samples:
                continue  # a group's aggregate, or a task without an accuracy
            correct = round(float(metrics[f"{metric},none"]) * samples)
            groups[task] = _items(correct, samples)
        if not groups:
            raise SweepError(
                f"{self.raw(folder)}: no task with an accuracy ({', '.join(LM_METRICS)})"
            )
        return groups


class LossEval(Evaluation):
    kind, metric = "loss", "training loss"
    higher_is_better, percent = False, False

    def settings(self):
        return {"kind": self.kind}

    def raw(self, folder):
        return folder / "tb"

    def command(self, folder, step_dir):
        return None

    def groups(self, folder):
        from canon_titan.components.metrics import LOSS_TAG, read_all_scalars

        series = read_all_scalars(str(folder), "tb").get(LOSS_TAG, {})
        if not series:
            raise SweepError(
                f"{folder}: no training loss in its TensorBoard events ([metrics] "
                'enable_tensorboard must be on for kind = "loss")'
            )
        return {"loss": {"value": series[max(series)], "step": max(series)}}


def from_settings(settings: dict) -> Evaluation:
    """The evaluation whose ``settings()`` these are (a SLURM array task scores with it)."""
    kind = settings["kind"]
    if kind == "synthetic":
        return SyntheticEval(settings["count"])
    if kind == "lm":
        return LmEval(settings["tasks"], settings["limit"])
    return LossEval()


def evaluation_of(spec: Spec, synthetic: bool) -> Evaluation:
    kind = spec.evaluation or ("synthetic" if synthetic else "loss")
    if kind == "synthetic" and not synthetic:
        raise SweepError(
            f'{spec.path}: [eval] kind = "synthetic": the base config trains on text; '
            'use "lm" or "loss"'
        )
    if kind == "synthetic":
        return SyntheticEval(spec.count)
    if kind == "lm":
        return LmEval(spec.lm_tasks, spec.lm_limit)
    return LossEval()
