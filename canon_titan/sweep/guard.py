"""``canon-titan sweep --check WINNER>LOSER:GROUP:POINTS``: a sweep as the guard of a promised
result (the quick start's: llama_canon beats llama on one-hop Depo by 40 points). Its arms and group
are checked before anything trains, so that a typo does not cost the sweep."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from canon_titan.sweep.budget import ArmRun
from canon_titan.sweep.scores import ALL, Evaluation, LmEval, LossEval
from canon_titan.sweep.spec import Spec, SweepError


@dataclass(frozen=True)
class Check:
    winner: str
    loser: str
    group: str
    points: float


def parse_check(text: str) -> Check:
    winner, _, rest = text.partition(">")
    rest, _, points = rest.rpartition(":")
    loser, _, group = rest.partition(":")
    try:
        if winner and loser and group:
            return Check(winner, loser, group, float(points))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"expected WINNER>LOSER:GROUP:POINTS such as llama_canon>llama:k=1:40, got {text!r}"
    )


def groups_before_training(arm_run: ArmRun, evaluation: Evaluation, spec: Spec) -> list[str]:
    if isinstance(evaluation, LossEval):
        return ["loss"]
    if isinstance(evaluation, LmEval):
        return list(spec.lm_tasks)
    from canon_titan.evaluation.synthetic import DEFAULT_TEST_SEED

    items = arm_run.run.task.test_items(DEFAULT_TEST_SEED, spec.count)
    return [*dict.fromkeys(item.group for item in items), ALL]


def check_names(check: Check, arm_runs: list[ArmRun], evaluation: Evaluation, spec: Spec) -> None:
    labels = list(dict.fromkeys(a.arm.label for a in arm_runs))
    for name in (check.winner, check.loser):
        if name not in labels:
            raise SweepError(f"--check: no arm {name!r}; the arms: {', '.join(labels)}")
    for arm_run in arm_runs:
        groups = groups_before_training(arm_run, evaluation, spec)
        if check.group not in groups:
            raise SweepError(
                f"--check: {arm_run.task.label} has no group {check.group!r}; "
                f"its groups: {', '.join(groups)}"
            )


def failures(check: Check, tasks, evaluation: Evaluation) -> list[str]:
    """The base configs where the winner does not beat the loser on the group by the points (the
    means over seeds, in percentage points for accuracies); each config's margin is printed."""
    scale = 100 if evaluation.percent else 1
    out = []
    for task in tasks:
        arms = {arm.label: arm for arm in task.arms}
        spreads = [arms[name].spread(check.group) for name in (check.winner, check.loser)]
        if None in spreads:
            out.append(
                f"{task.label}: {check.winner} or {check.loser} has no score on {check.group}"
            )
            continue
        a, b = (scale * s.mean for s in spreads)
        margin = a - b if evaluation.higher_is_better else b - a
        print(
            f"[sweep] check {task.label} {check.group}: {check.winner} {a:.1f} - {check.loser} "
            f"{b:.1f} = {margin:+.1f} (need >= {check.points:g}): "
            + ("ok" if margin >= check.points else "FAILED")
        )
        if margin < check.points:
            out.append(
                f"{task.label}: {check.winner} beats {check.loser} on {check.group} by "
                f"{margin:+.1f}, not the {check.points:g} required"
            )
    return out
