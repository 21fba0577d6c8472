"""Matched budgets: every cell of a task spends the same tokens (the default), the same training
FLOPs, or the same planned GPU-hours on a named GPU, and its steps follow from what one of its steps
costs. FLOPs and GPU-hours are the planner's (``canon-titan plan``: the FLOPs it counts on the step
itself, Canon layers and the recurrences included; the step time it predicts for that GPU).

The budget is ``[budget] tokens`` / ``flops`` / ``gpu_hours`` when given, else what the first arm
spends in ``[budget] steps`` (default: its config's ``[training] steps``), per base config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from unittest.mock import patch

from canon_titan.config import ConfigError, load
from canon_titan.config.run import RunConfig
from canon_titan.sweep.cells import Cell, Task, task_label
from canon_titan.sweep.spec import Arm, Spec, SweepError, override_args
from synthetic_data.tasks import changed_params


@dataclass
class ArmRun:
    """One arm of one base config, resolved (every key checked) before anything trains."""

    task: Task
    arm: Arm
    run: RunConfig
    tokens_per_step: int
    cost_per_step: float
    """In the budget's unit: tokens, FLOPs or GPU-hours."""
    steps: int = 0

    @property
    def test_set(self):
        """What its test items depend on: arms with equal ones were scored on the same items."""
        task = self.run.task
        return None if task is None else (task.name, tuple(sorted(vars(task.params).items())))


@dataclass
class Budget:
    kind: str
    per_task: dict[str, float]
    """Budget per cell of each base config, in the kind's unit."""
    source: dict[str, str]
    """How each was set, in words."""


UNITS = {"tokens": "tokens", "flops": "FLOPs", "gpu_hours": "GPU-hours"}


def describe(run) -> str:
    data = run["dataloader"]
    if run.task is not None:
        changed = ", ".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in changed_params(run.task).items()
        )
        return f"{run.task.name}" + (f" with {changed}" if changed else " (its preset)")
    return (
        f"{data['dataset']}"
        + (f" {data['dataset_path']}" if data["dataset_path"] else "")
        + " text"
    )


def _resolve(spec: Spec, config: str, arm: Arm, world: int):
    args = override_args(spec.fixed_overrides() + arm.overrides())
    try:
        with patch.dict(os.environ, WORLD_SIZE=str(world)):
            return load(config, args, environment=False), args
    except ConfigError as e:
        raise SweepError(f"{spec.path}: arm {arm.label} of {config}: {e}") from None


def _cost(spec: Spec, config: str, args: list[str], run, world: int) -> float:
    if spec.budget == "tokens":
        return tokens_per_step(run, world)
    from canon_titan.plan.gpus import UnknownGPU, find_gpu
    from canon_titan.plan.planner import PlanError, plan

    try:
        gpu = find_gpu(spec.gpu)
        gpus = spec.gpus or world
        planned = plan(config, args, gpus=gpus, gpu=gpu, advise=False)
    except (UnknownGPU, PlanError, ConfigError) as e:
        raise SweepError(
            f"{spec.path}: [budget] match = {spec.budget!r}: planning {config} {' '.join(args)}: "
            f"{e}"
        ) from None
    if (
        spec.budget == "flops"
    ):  # each rank's counted FLOPs; under PP one rank of each stage was planned
        return sum(k.model_flops for k in planned.kinds) * gpus / len(planned.kinds)
    return planned.step_s * gpus / 3600


def tokens_per_step(run, world: int) -> int:
    training = run["training"]
    batch = training["global_batch_size"]
    if batch <= 0:
        batch = training["local_batch_size"] * run.data_parallel_size(world)
    return batch * training["seq_len"]


def plan_sweep(spec: Spec, slurm: bool = False) -> tuple[list[ArmRun], Budget]:
    """Every arm of every base config resolved and costed, and its steps under the budget."""
    world = spec.world_size(slurm)
    arm_runs, per_task, source = [], {}, {}
    for config in spec.configs:
        first = None
        for arm in spec.arms():
            run, args = _resolve(spec, config, arm, world)
            if first is None:
                task = Task(config, task_label(config), describe(run))
            cost = _cost(spec, config, args, run, world)
            arm_runs.append(ArmRun(task, arm, run, tokens_per_step(run, world), cost))
            first = first or arm_runs[-1]
        if spec.budget_value is not None:
            per_task[task.label] = spec.budget_value
            source[task.label] = "[budget] " + spec.budget
        else:
            steps = spec.budget_steps or first.run["training"]["steps"]
            per_task[task.label] = first.cost_per_step * steps
            source[task.label] = f"what {first.arm.label} spends in {steps:,} steps"
    for arm_run in arm_runs:
        arm_run.steps = max(1, round(per_task[arm_run.task.label] / arm_run.cost_per_step))
    labels = [t.label for t in {a.task for a in arm_runs}]
    if len(set(labels)) != len(labels):
        raise SweepError(
            f"{spec.path}: [sweep] config: two configs have the same name ({', '.join(labels)})"
        )
    return arm_runs, Budget(spec.budget, per_task, source)


def cells_of(spec: Spec, arm_runs: list[ArmRun], slurm: bool = False) -> list[Cell]:
    cells = []
    for arm_run in arm_runs:
        run = arm_run.run
        for seed in spec.seeds:
            seeds = [("job.seed", seed), ("dataloader.seed", seed)]
            if (
                run["model"]["seed"] is not None
            ):  # pinned (the release recipes' 42): each cell's own
                seeds.append(("model.seed", seed))
            overrides = override_args(spec.fixed_overrides() + arm_run.arm.overrides() + seeds)
            folder = spec.out / "cells" / arm_run.task.label / arm_run.arm.folder / f"seed-{seed}"
            cells.append(
                Cell(
                    arm_run.task,
                    arm_run.arm,
                    seed,
                    arm_run.steps,
                    folder,
                    spec.nproc,
                    tuple(overrides),
                )
            )
    return cells


def budget_table(arm_runs: list[ArmRun], budget: Budget) -> str:
    """The budget and each arm's steps, printed before anything trains."""
    unit = UNITS[budget.kind]
    lines = []
    for label, value in budget.per_task.items():
        lines.append(
            f"[sweep] {label}: budget {amount(value, budget.kind)} {unit} per cell "
            f"({budget.source[label]}), matched on {unit}"
        )
        for a in (a for a in arm_runs if a.task.label == label):
            spent = a.steps * a.cost_per_step
            cost = (
                ""
                if budget.kind == "tokens"
                else f", {amount(a.cost_per_step, budget.kind)} {unit} a step"
            )
            total = "" if budget.kind == "tokens" else f", {amount(spent, budget.kind)} {unit}"
            lines.append(
                f"[sweep]   {a.arm.label:<24} {a.steps:>7,} steps of {a.tokens_per_step:,} tokens"
                f"{cost}: {a.steps * a.tokens_per_step:,} tokens{total}"
            )
    return "\n".join(lines)


def amount(value: float, kind: str) -> str:
    """A budget in its unit's usual form: 614,400 (tokens), 1.234e+15 (FLOPs), 0.5 (GPU-hours)."""
    if kind == "tokens":
        return f"{value:,.0f}"
    if kind == "flops":
        return f"{value:.3e}"
    return f"{value:.4g}"
