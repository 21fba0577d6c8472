"""A sweep's result: per base config, arm and evaluation group the mean over seeds with its
interval, each seed's own value with its interval over the test items, and every one-axis
difference between two arms with its interval, p-value and verdict; as markdown and as JSON."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from canon_titan.sweep import stats
from canon_titan.sweep.budget import UNITS, ArmRun, Budget, amount
from canon_titan.sweep.scores import ALL, Evaluation
from canon_titan.sweep.spec import value_label


@dataclass
class ArmResult:
    run: ArmRun
    seeds: dict[int, dict] = field(default_factory=dict)
    """seed -> that cell's scores (``scores.json``)."""

    @property
    def label(self) -> str:
        return self.run.arm.label

    def groups(self) -> list[str]:
        names: dict[str, None] = {}
        for scores in self.seeds.values():
            names.update(dict.fromkeys(scores["groups"]))
        return list(names)

    def spread(self, group: str) -> stats.Spread | None:
        values = [s["groups"][group]["value"] for s in self.seeds.values() if group in s["groups"]]
        return stats.across_seeds(values) if values else None

    def items(self, group: str) -> dict[int, np.ndarray]:
        """seed -> the group's item scores (1/0), or its single value when it has no items."""
        out = {}
        for seed, scores in self.seeds.items():
            g = scores["groups"].get(group)
            if g is None:
                continue
            if "scores" in g:
                out[seed] = np.asarray(g["scores"], dtype=float)
            elif "total" in g:  # a count without its items (lm-eval): as many ones as were right
                out[seed] = np.repeat([1.0, 0.0], [g["correct"], g["total"] - g["correct"]])
            else:
                out[seed] = np.asarray([g["value"]], dtype=float)
        return out


@dataclass
class Comparison:
    a: str
    b: str
    axis: str
    group: str
    difference: stats.Difference
    verdict: str


@dataclass
class TaskResult:
    label: str
    description: str
    arms: list[ArmResult]
    comparisons: list[Comparison] = field(default_factory=list)

    def groups(self) -> list[str]:
        names: dict[str, None] = {}
        for arm in self.arms:
            names.update(dict.fromkeys(arm.groups()))
        if ALL in names:  # last
            del names[ALL]
            names[ALL] = None
        return list(names)

    def test_set(self) -> str | None:
        for arm in self.arms:
            for scores in arm.seeds.values():
                if scores.get("test_set"):
                    return scores["test_set"]
        return None


def differ_in_one_axis(a: ArmRun, b: ArmRun) -> str | None:
    differing = [
        axis for (axis, x), (_, y) in zip(a.arm.values, b.arm.values, strict=True) if x != y
    ]
    return differing[0] if len(differing) == 1 else None


def collect(
    arm_runs: list[ArmRun], scores: dict[tuple[str, str, int], dict], evaluation: Evaluation
) -> list[TaskResult]:
    """The results of every base config from the cells' ``scores`` ((config label, arm label,
    seed) -> scores; cells that have not finished are absent)."""
    tasks: dict[str, TaskResult] = {}
    for run in arm_runs:
        arm = ArmResult(
            run,
            {
                seed: record
                for (task, label, seed), record in scores.items()
                if task == run.task.label and label == run.arm.label
            },
        )
        tasks.setdefault(run.task.label, TaskResult(run.task.label, run.task.description, []))
        tasks[run.task.label].arms.append(arm)
    for task in tasks.values():
        # a is the arm with the later value of the axis they differ in, b the earlier
        for b, a in itertools.combinations(task.arms, 2):
            axis = differ_in_one_axis(a.run, b.run)
            if axis is not None:
                task.comparisons += compare(a, b, axis, task.groups(), evaluation)
    return list(tasks.values())


def compare(
    a: ArmResult, b: ArmResult, axis: str, groups: list[str], evaluation: Evaluation
) -> list[Comparison]:
    out = []
    for group in groups:
        # item by item when both were scored on the same test set and kept each item's score
        same = a.run.test_set == b.run.test_set and all(
            "scores" in s["groups"].get(group, {}) for arm in (a, b) for s in arm.seeds.values()
        )
        d = stats.paired_difference(a.items(group), b.items(group), same_items=same)
        if d is not None:
            out.append(
                Comparison(
                    a.label,
                    b.label,
                    axis,
                    group,
                    d,
                    verdict(d, a.label, b.label, group, evaluation),
                )
            )
    return out


def _number(value: float, evaluation: Evaluation, signed: bool = False) -> str:
    if evaluation.percent:
        return f"{100 * value:+.0f}" if signed else f"{100 * value:.0f}"
    return f"{value:+.3g}" if signed else f"{value:.3g}"


def interval_text(low: float, high: float, evaluation: Evaluation) -> str:
    if low >= 0:
        return f"({_number(low, evaluation)}-{_number(high, evaluation)})"
    return f"({_number(low, evaluation)} to {_number(high, evaluation)})"


def verdict(d: stats.Difference, a: str, b: str, group: str, evaluation: Evaluation) -> str:
    """In words: "llama_canon beats llama on k=1 by 41 points (31-50), real at 3 seeds"."""
    unit = " points" if evaluation.percent else ""
    a_wins = (d.mean > 0) == evaluation.higher_is_better
    winner, loser = (a, b) if a_wins else (b, a)
    margin, low, high = (d.mean, d.low, d.high) if d.mean >= 0 else (-d.mean, -d.high, -d.low)
    if d.real and d.mean != 0:
        where = (
            f"real at {d.seeds} seeds"
            if d.seeds > 1
            else "real over the test items (1 seed: seed noise not measured)"
        )
        return (
            f"{winner} beats {loser} on {group} by {_number(margin, evaluation)}{unit} "
            f"{interval_text(low, high, evaluation)}, {where}"
        )
    noise = "within seed noise" if d.seeds > 1 else "within the test items' noise (1 seed)"
    return (
        f"{a} vs {b} on {group}: {_number(d.mean, evaluation, signed=True)}{unit} "
        f"{interval_text(d.low, d.high, evaluation)}, {noise}"
    )


def _value(value: float, evaluation: Evaluation) -> str:
    return f"{100 * value:.1f}" if evaluation.percent else f"{value:.4g}"


def _bounded(low: float, high: float, evaluation: Evaluation) -> tuple[float, float]:
    return (max(0.0, low), min(1.0, high)) if evaluation.percent else (low, high)


def seed_cell(group: dict, evaluation: Evaluation) -> str:
    """One seed's value, with its 95% Wilson interval over the items where it has them."""
    if "total" not in group:
        return _value(group["value"], evaluation)
    low, high = stats.wilson(group["correct"], group["total"])
    return f"{_value(group['value'], evaluation)} ({100 * low:.0f}-{100 * high:.0f})"


def arm_cell(arm: ArmResult, group: str, evaluation: Evaluation) -> str:
    """The mean over seeds and its 95% interval; one seed: that seed's interval over the items."""
    spread = arm.spread(group)
    if spread is None:
        return ""
    if spread.seeds == 1:
        (scores,) = [s for s in arm.seeds.values() if group in s["groups"]]
        return seed_cell(scores["groups"][group], evaluation)
    low, high = _bounded(spread.low, spread.high, evaluation)
    if evaluation.percent:
        return f"{100 * spread.mean:.1f} ({100 * low:.0f}-{100 * high:.0f})"
    return f"{spread.mean:.4g} ({low:.4g} to {high:.4g})"


def _seconds(records: list[dict]) -> str:
    seconds = [r["train_seconds"] for r in records if r.get("train_seconds") is not None]
    return f"{sum(seconds) / len(seconds):.0f} s" if seconds else ""


def _group_sizes(task: TaskResult) -> str:
    for arm in task.arms:
        for scores in arm.seeds.values():
            sizes = [
                f"{name} {g['total']}"
                for name, g in scores["groups"].items()
                if name != ALL and "total" in g
            ]
            if sizes:
                return ", ".join(sizes)
    return ""


def markdown(
    tasks: list[TaskResult], budget: Budget, evaluation: Evaluation, seeds: list[int]
) -> str:
    what = f"{evaluation.metric}{' in %' if evaluation.percent else ''}"
    out = []
    for task in tasks:
        groups = task.groups()
        arms = task.arms
        axes = [axis for axis, _ in arms[0].run.arm.values]
        measured = max(len(a.seeds) for a in arms)
        header = [f"### {task.label} ({task.description})", ""]
        test_set = task.test_set()
        if test_set:
            sizes = _group_sizes(task)
            header.append(
                f"Test set: {test_set}" + (f" (items per group: {sizes})" if sizes else "") + "."
            )
        per_cell = amount(budget.per_task[task.label], budget.kind)
        header.append(
            f"Budget: {per_cell} {UNITS[budget.kind]} per cell ({budget.source[task.label]}). "
            + (
                f"{what.capitalize()}: the mean over {measured} seeds, its 95% interval over seeds."
                if measured > 1
                else f"{what.capitalize()}, one seed, with its 95% interval over the test items."
            )
        )
        lines = header + [
            "",
            "| arm | " + " | ".join(groups) + " | steps | training |",
            "|---|" + "---|" * (len(groups) + 2),
        ]
        for arm in arms:
            done = (
                f" ({len(arm.seeds)} of {len(seeds)} seeds)" if len(arm.seeds) < len(seeds) else ""
            )
            cells = [arm_cell(arm, g, evaluation) for g in groups]
            lines.append(
                f"| {arm.label}{done} | " + " | ".join(cells) + f" | {arm.run.steps:,} | "
                f"{_seconds(list(arm.seeds.values()))} |"
            )
        if measured > 1:
            lines += [
                "",
                "Each seed, with its 95% interval over the test items:",
                "",
                "| arm | seed | " + " | ".join(groups) + " | training |",
                "|---|---|" + "---|" * (len(groups) + 1),
            ]
            for arm in arms:
                for seed, scores in sorted(arm.seeds.items()):
                    cells = [
                        seed_cell(scores["groups"][g], evaluation) if g in scores["groups"] else ""
                        for g in groups
                    ]
                    lines.append(
                        f"| {arm.label} | {seed} | "
                        + " | ".join(cells)
                        + f" | {_seconds([scores])} |"
                    )
        if task.comparisons:
            unit = "points" if evaluation.percent else evaluation.metric
            lines += [
                "",
                f"Differences between arms that differ in one axis ({', '.join(axes)}): a minus b "
                f"in {unit} over the seeds both have, its 95% interval over seeds and test items, "
                "and the p-value of no difference:",
                "",
                "| a | b | group | a - b | interval | p | verdict |",
                "|---|---|---|---|---|---|---|",
            ]
            for c in task.comparisons:
                d = c.difference
                lines.append(
                    f"| {c.a} | {c.b} | {c.group} | {_number(d.mean, evaluation, signed=True)} | "
                    f"{interval_text(d.low, d.high, evaluation)} | {d.p:.3g} | {c.verdict} |"
                )
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def as_json(
    tasks: list[TaskResult], budget: Budget, evaluation: Evaluation, spec_path: str
) -> dict:
    def spread(s: stats.Spread | None):
        return (
            None if s is None else {"mean": s.mean, "low": s.low, "high": s.high, "seeds": s.seeds}
        )

    return {
        "spec": spec_path,
        "evaluation": evaluation.settings(),
        "metric": evaluation.metric,
        "higher_is_better": evaluation.higher_is_better,
        "budget": {"match": budget.kind, "per_cell": budget.per_task, "source": budget.source},
        "tasks": {
            task.label: {
                "description": task.description,
                "test_set": task.test_set(),
                "groups": task.groups(),
                "arms": {
                    arm.label: {
                        "axes": {axis: value_label(v) for axis, v in arm.run.arm.values},
                        "steps": arm.run.steps,
                        "tokens_per_step": arm.run.tokens_per_step,
                        "groups": {g: spread(arm.spread(g)) for g in task.groups()},
                        "seeds": {
                            str(seed): {
                                "groups": {
                                    g: {k: v for k, v in data.items() if k != "scores"}
                                    for g, data in scores["groups"].items()
                                },
                                "train_seconds": scores.get("train_seconds"),
                            }
                            for seed, scores in sorted(arm.seeds.items())
                        },
                    }
                    for arm in task.arms
                },
                "comparisons": [
                    {
                        "a": c.a,
                        "b": c.b,
                        "axis": c.axis,
                        "group": c.group,
                        "difference": c.difference.mean,
                        "low": c.difference.low,
                        "high": c.difference.high,
                        "p": c.difference.p,
                        "seeds": c.difference.seeds,
                        "items_paired": c.difference.items_paired,
                        "verdict": c.verdict,
                    }
                    for c in task.comparisons
                ],
            }
            for task in tasks
        },
    }
