"""A sweep's spec: a TOML file naming the base configs, the axes to cross, the seeds, the budget
and the evaluation (docs/experiments.md has the format).

``read_spec(path)`` checks every key before anything is resolved or trained and raises
``SweepError`` naming the file, the key and what is allowed.
"""

from __future__ import annotations

import itertools
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUDGETS = ("tokens", "flops", "gpu_hours")
EVALUATIONS = ("synthetic", "lm", "loss")
SEED_KEYS = ("job.seed", "dataloader.seed")
"""What a cell's seed sets: the weights' initialisation ([model] seed unset) and the data order. A
base config that pins ``[model] seed`` (the release recipes: 42) has it set too."""
BUDGET_KEYS = ("training.steps",)
"""Set by the budget for every cell; a spec sets ``[budget] steps`` instead."""
_KEY = re.compile(r"[a-z_][a-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*")


class SweepError(ValueError):
    """A spec, a cell or a command line that cannot be run; the message is one line."""


@dataclass(frozen=True)
class Arm:
    """One point of the axes' product: its value on every axis and the overrides they make."""

    values: tuple[tuple[str, Any], ...]
    """(axis, value) in the spec's axis order; a linked axis's value is a table of keys."""

    def overrides(self) -> list[tuple[str, Any]]:
        out = []
        for axis, value in self.values:
            out += list(value.items()) if isinstance(value, dict) else [(axis, value)]
        return out

    @property
    def label(self) -> str:
        """The values, as a reader names the arm: ``llama_canon``, ``gla5 AbCD``, ``""``."""
        return " ".join(value_label(v) for _, v in self.values) or "base"

    @property
    def folder(self) -> str:
        """A folder name of its own: ``name=llama_canon``, ``canon_set=-`` for an empty value."""
        if not self.values:
            return "base"
        parts = [
            f"{axis.rsplit('.', 1)[-1]}={_slug(value_label(v, empty='-'))}"
            for axis, v in self.values
        ]
        return ",".join(parts)

    def value(self, axis: str):
        return dict(self.values)[axis]


def value_label(value, empty: str = '""') -> str:
    if isinstance(value, dict):
        return " ".join(value_label(v, empty) for v in value.values())
    if value == "":
        return empty
    return str(value).lower() if isinstance(value, bool) else str(value)


def _slug(text: str) -> str:
    return re.sub(r"[^\w.+=-]", "_", text.replace(" ", "+"))


@dataclass
class Spec:
    path: Path
    name: str
    configs: list[str]
    seeds: list[int]
    axes: dict[str, list]
    fixed: dict[str, Any] = field(default_factory=dict)
    """``[set]``: overrides of every cell."""
    exclude: list[dict[str, Any]] = field(default_factory=list)
    nproc: int = 1
    out: Path = Path()
    budget: str = "tokens"
    budget_value: float | None = None
    """tokens, FLOPs or GPU-hours per cell; None: what the first arm spends in ``budget_steps``."""
    budget_steps: int | None = None
    """The first arm's steps the budget is taken from (None: its config's ``[training] steps``)."""
    gpu: str = "h100"
    gpus: int | None = None
    """GPUs a cell is planned on for the FLOP and GPU-hour budgets (None: the cell's world size)."""
    evaluation: str | None = None
    """None: ``synthetic`` for a synthetic task, ``loss`` for text."""
    count: int = 100
    lm_tasks: list[str] = field(default_factory=list)
    lm_limit: float | None = None
    slurm_nodes: int = 1
    slurm_gpus_per_node: int = 8

    def arms(self) -> list[Arm]:
        names = list(self.axes)
        arms = [
            Arm(tuple(zip(names, combo, strict=True)))
            for combo in itertools.product(*self.axes.values())
        ]
        return [arm for arm in arms if not any(_matches(arm, rule) for rule in self.exclude)]

    def fixed_overrides(self) -> list[tuple[str, Any]]:
        return list(self.fixed.items())

    def world_size(self, slurm: bool) -> int:
        return self.slurm_nodes * self.slurm_gpus_per_node if slurm else self.nproc


def _matches(arm: Arm, rule: dict) -> bool:
    return all(arm.value(axis) == value for axis, value in rule.items())


def override_args(pairs: list[tuple[str, Any]]) -> list[str]:
    """``--section.key=VALUE`` arguments, each value a TOML literal (an empty string stays one)."""
    return [f"--{key}={json.dumps(value)}" for key, value in pairs]


def read_spec(path: str | Path) -> Spec:
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise SweepError(f"{where}: no such spec file")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SweepError(f"{where}: not valid TOML: {e}") from None
    allowed = {"sweep", "axes", "set", "budget", "eval", "slurm"}
    for section, body in raw.items():
        if section not in allowed or not isinstance(body, dict):
            raise SweepError(
                f"{where}: [{section}]: unknown section; allowed: {', '.join(sorted(allowed))}"
            )
    sweep = _table(raw, "sweep", where, {"config", "seeds", "out", "nproc", "exclude"})
    configs = sweep.get("config")
    configs = [configs] if isinstance(configs, str) else configs
    if (
        not configs
        or not isinstance(configs, list)
        or not all(isinstance(c, str) and c for c in configs)
    ):
        raise SweepError(f"{where}: [sweep] config: required, a config file or a list of them")
    for config in configs:
        if not Path(config).is_file():
            raise SweepError(
                f"{where}: [sweep] config: no such file {config!r} (relative paths are read from "
                "the current directory)"
            )
    seeds = sweep.get("seeds")
    if (
        not isinstance(seeds, list)
        or not seeds
        or len(set(seeds)) != len(seeds)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
    ):
        raise SweepError(
            f"{where}: [sweep] seeds: required, a list of distinct integers >= 0, got {seeds!r}"
        )
    nproc = sweep.get("nproc", 1)
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise SweepError(
            f"{where}: [sweep] nproc: processes per cell, an integer >= 1, got {nproc!r}"
        )
    spec = Spec(
        path=path,
        name=path.stem,
        configs=configs,
        seeds=seeds,
        axes=_axes(raw.get("axes", {}), where),
        fixed=_fixed(raw.get("set", {}), where),
        nproc=nproc,
    )
    spec.out = Path(sweep.get("out", f"outputs/sweeps/{spec.name}"))
    spec.exclude = _exclude(sweep.get("exclude", []), spec.axes, where)
    if not spec.arms():
        raise SweepError(f"{where}: [sweep] exclude: leaves no arm to train")
    _budget(raw.get("budget", {}), spec, where)
    _evaluation(raw.get("eval", {}), spec, where)
    slurm = _table(raw, "slurm", where, {"nodes", "gpus_per_node"})
    for key in ("nodes", "gpus_per_node"):
        value = slurm.get(key, getattr(spec, f"slurm_{key}"))
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SweepError(f"{where}: [slurm] {key}: an integer >= 1, got {value!r}")
        setattr(spec, f"slurm_{key}", value)
    return spec


def _table(raw: dict, name: str, where: str, keys: set[str]) -> dict:
    body = raw.get(name, {})
    for key in body:
        if key not in keys:
            raise SweepError(
                f"{where}: [{name}] {key}: unknown key; allowed: {', '.join(sorted(keys))}"
            )
    return body


def _check_key(key: str, where: str, section: str) -> None:
    if not _KEY.fullmatch(key):
        raise SweepError(
            f'{where}: [{section}] {key!r}: expected a config key "section.key" (quoted, as '
            'on the command line without its --), e.g. "model.canon_set"'
        )
    if key in BUDGET_KEYS:
        raise SweepError(
            f"{where}: [{section}] {key}: the budget sets every cell's steps; set [budget] steps "
            "(the first arm's) or tokens, flops or gpu_hours"
        )
    if key in SEED_KEYS or key == "model.seed":
        raise SweepError(
            f"{where}: [{section}] {key}: set by each cell's seed; list them in [sweep] seeds"
        )
    if key == "job.dump_folder":
        raise SweepError(f"{where}: [{section}] {key}: every cell has its own, under [sweep] out")


def _axes(raw: dict, where: str) -> dict[str, list]:
    axes = {}
    for name, values in raw.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}: [axes] {name}: a non-empty list of values")
        if all(isinstance(v, dict) for v in values):  # a linked axis: each value sets several keys
            for table in values:
                if not table:
                    raise SweepError(f"{where}: [axes] {name}: an empty table sets nothing")
                for key in table:
                    _check_key(key, where, "axes")
        elif any(isinstance(v, dict) for v in values):
            raise SweepError(
                f"{where}: [axes] {name}: either values of the key or tables of keys, not both"
            )
        else:
            _check_key(name, where, "axes")
        labels = [value_label(v) for v in values]
        if len(set(labels)) != len(labels):
            raise SweepError(
                f"{where}: [axes] {name}: a value is listed twice ({', '.join(labels)})"
            )
        axes[name] = values
    return axes


def _fixed(raw: dict, where: str) -> dict[str, Any]:
    for key in raw:
        _check_key(key, where, "set")
    return dict(raw)


def _exclude(rules, axes: dict[str, list], where: str) -> list[dict]:
    if not isinstance(rules, list) or not all(isinstance(r, dict) and r for r in rules):
        raise SweepError(f"{where}: [sweep] exclude: a list of tables {{axis = value, ...}}")
    for rule in rules:
        for axis, value in rule.items():
            if axis not in axes:
                raise SweepError(
                    f"{where}: [sweep] exclude: {axis!r} is not an axis; axes: {', '.join(axes)}"
                )
            if value not in axes[axis]:
                raise SweepError(
                    f"{where}: [sweep] exclude: {axis} = {value!r} is not one of its values"
                )
    return rules


def _number(body: dict, key: str, where: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise SweepError(f"{where}: [budget] {key}: a number > 0, got {value!r}")
    return float(value)


def _budget(body: dict, spec: Spec, where: str) -> None:
    keys = {"match", "steps", *BUDGETS, "gpu", "gpus"}
    _table({"budget": body}, "budget", where, keys)
    spec.budget = body.get("match", "tokens")
    if spec.budget not in BUDGETS:
        raise SweepError(
            f"{where}: [budget] match: one of {', '.join(BUDGETS)}, got {spec.budget!r}"
        )
    for other in BUDGETS:
        if other != spec.budget and other in body:
            raise SweepError(
                f"{where}: [budget] {other}: the budget is matched on {spec.budget} "
                f"([budget] match); give [budget] {spec.budget} instead"
            )
    spec.budget_value = _number(body, spec.budget, where)
    steps = body.get("steps")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise SweepError(
            f"{where}: [budget] steps: an integer >= 1 (the first arm's steps), got {steps!r}"
        )
    if steps is not None and spec.budget_value is not None:
        raise SweepError(
            f"{where}: [budget] steps and {spec.budget}: give one (steps: what the first arm "
            "spends in that many steps is every cell's budget)"
        )
    spec.budget_steps = steps
    spec.gpu = body.get("gpu", spec.gpu)
    if not isinstance(spec.gpu, str):
        raise SweepError(
            f"{where}: [budget] gpu: a GPU name as canon-titan plan --gpu takes, got {spec.gpu!r}"
        )
    gpus = body.get("gpus")
    if gpus is not None and (not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1):
        raise SweepError(f"{where}: [budget] gpus: an integer >= 1, got {gpus!r}")
    spec.gpus = gpus


def _evaluation(body: dict, spec: Spec, where: str) -> None:
    _table({"eval": body}, "eval", where, {"kind", "count", "tasks", "limit"})
    kind = body.get("kind")
    if kind is not None and kind not in EVALUATIONS:
        raise SweepError(f"{where}: [eval] kind: one of {', '.join(EVALUATIONS)}, got {kind!r}")
    spec.evaluation = kind
    count = body.get("count", spec.count)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise SweepError(
            f"{where}: [eval] count: test items per group, an integer >= 1, got {count!r}"
        )
    spec.count = count
    tasks = body.get("tasks", [])
    if not isinstance(tasks, list) or not all(isinstance(t, str) and t for t in tasks):
        raise SweepError(f"{where}: [eval] tasks: a list of lm-eval task or suite names")
    if kind == "lm" and not tasks:
        raise SweepError(f'{where}: [eval] tasks: kind = "lm" needs the lm-eval tasks to score')
    if tasks and kind != "lm":
        raise SweepError(f'{where}: [eval] tasks: only for kind = "lm"')
    spec.lm_tasks = tasks
    limit = body.get("limit")
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0
    ):
        raise SweepError(
            f"{where}: [eval] limit: items per lm-eval task (a fraction if < 1), got {limit!r}"
        )
    spec.lm_limit = limit
