"""A sweep's figures, drawn from its ``results.json`` (so that they can be drawn again from it):

* ``accuracy.png``: one panel per base config, a bar per evaluation group and arm (the mean over
  seeds) with its 95% interval (over seeds; with one seed, over the test items), each seed a dot;
* ``heatmap.png``: every arm against every base config's groups, one figure across tasks.
"""

from __future__ import annotations

import io
from pathlib import Path

from canon_titan.sweep import stats
from canon_titan.tools.fileio import write_atomic


class PlotError(ValueError):
    """A results file the figures cannot be drawn from (the message names what is missing)."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    png = io.BytesIO()
    fig.savefig(png, dpi=110, format="png")
    _pyplot().close(fig)
    write_atomic(path, png.getvalue())


def _scale(results: dict) -> float:
    return 100.0 if results["evaluation"]["kind"] != "loss" else 1.0


def _bar(arm: dict, group: str, scale: float) -> tuple[float, float, float, list[float]] | None:
    """(height, below, above, each seed's value) of one bar; below and above are >= 0."""
    spread = arm["groups"].get(group)
    if spread is None:
        return None
    seeds = [s["groups"][group] for s in arm["seeds"].values() if group in s["groups"]]
    mean = spread["mean"]
    if spread["low"] is not None:
        low, high = spread["low"], spread["high"]
    elif "total" in seeds[0]:
        low, high = stats.wilson(seeds[0]["correct"], seeds[0]["total"])
    else:
        low = high = mean
    if scale == 100.0:
        low, high = max(0.0, low), min(1.0, high)
    return (
        scale * mean,
        scale * max(0.0, mean - low),
        scale * max(0.0, high - mean),
        [scale * s["value"] for s in seeds],
    )


def accuracy_figure(results: dict, path: Path) -> None:
    plt = _pyplot()
    tasks = results["tasks"]
    scale = _scale(results)
    fig, axes = plt.subplots(
        1, len(tasks), figsize=(max(4.8, 1.1 * _widest(tasks)) * len(tasks), 4.0), squeeze=False
    )
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (label, task) in zip(axes[0], tasks.items(), strict=True):
        groups, arms = task["groups"], list(task["arms"].items())
        width = 0.8 / len(arms)
        for i, (name, arm) in enumerate(arms):
            colour = colours[i % len(colours)]
            for g, group in enumerate(groups):
                bar = _bar(arm, group, scale)
                if bar is None:
                    continue
                height, below, above, seeds = bar
                x = g + (i - (len(arms) - 1) / 2) * width
                ax.bar(
                    x,
                    height,
                    width,
                    yerr=[[below], [above]],
                    capsize=3,
                    color=colour,
                    label=name if g == 0 else None,
                )
                ax.plot([x] * len(seeds), seeds, "o", color="black", markersize=2.5, alpha=0.6)
                ax.annotate(
                    f"{height:.0f}" if scale == 100.0 else f"{height:.3g}",
                    (x, height + above),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.set_xticks(range(len(groups)), groups)
        ax.set_xlim(-0.5, len(groups) - 0.5)
        if scale == 100.0:
            ax.set_ylim(0, 112)
        ax.set_ylabel(f"{results['metric']}{' (%)' if scale == 100.0 else ''}, 95% interval")
        ax.set_title(f"{label}\n{task['description']}", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    _save(fig, path)


def _widest(tasks: dict) -> int:
    return max(len(t["groups"]) * max(1, len(t["arms"])) // 2 + 2 for t in tasks.values())


def heatmap_figure(results: dict, path: Path) -> None:
    """Arms (rows, in the first config's order) against every (config, group)."""
    plt = _pyplot()
    import numpy as np

    scale = _scale(results)
    columns = [
        (label, group) for label, task in results["tasks"].items() for group in task["groups"]
    ]
    arms = list(dict.fromkeys(name for task in results["tasks"].values() for name in task["arms"]))
    values = np.full((len(arms), len(columns)), np.nan)
    for j, (label, group) in enumerate(columns):
        for i, name in enumerate(arms):
            spread = results["tasks"][label]["arms"].get(name, {}).get("groups", {}).get(group)
            if spread is not None:
                values[i, j] = scale * spread["mean"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(columns), 1.0 + 0.45 * len(arms)))
    cmap = "viridis" if results["higher_is_better"] else "viridis_r"
    image = ax.imshow(
        values,
        cmap=cmap,
        aspect="auto",
        vmin=0 if scale == 100.0 else None,
        vmax=100 if scale == 100.0 else None,
    )
    for i in range(len(arms)):
        for j in range(len(columns)):
            if not np.isnan(values[i, j]):
                ax.text(
                    j,
                    i,
                    f"{values[i, j]:.0f}" if scale == 100.0 else f"{values[i, j]:.3g}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if values[i, j] < np.nanmean(values) else "black",
                )
    several = len(results["tasks"]) > 1
    ax.set_xticks(
        range(len(columns)),
        [f"{label}\n{group}" if several else group for label, group in columns],
        fontsize=7,
        rotation=45 if several else 0,
        ha="right" if several else "center",
    )
    ax.set_yticks(range(len(arms)), arms, fontsize=8)
    ax.set_title(
        f"mean {results['metric']} over seeds"
        + ("" if several else f": {next(iter(results['tasks']))}"),
        fontsize=9,
    )
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    _save(fig, path)


def check_results(results: dict) -> None:
    """PlotError naming the first thing the figures need that ``results`` lacks."""

    def need(table, key, where):
        if not isinstance(table, dict) or key not in table:
            raise PlotError(f"not a sweep's results.json: no {key!r} in {where}")
        return table[key]

    for key in ("metric", "higher_is_better"):
        need(results, key, "it")
    need(need(results, "evaluation", "it"), "kind", "'evaluation'")
    for label, task in need(results, "tasks", "it").items():
        for key in ("groups", "description"):
            need(task, key, f"task {label!r}")
        for name, arm in need(task, "arms", f"task {label!r}").items():
            need(arm, "groups", f"arm {name!r} of {label!r}")
            need(arm, "seeds", f"arm {name!r} of {label!r}")


def draw(results: dict, folder: Path) -> list[Path]:
    """Both figures under ``folder``."""
    check_results(results)
    paths = [folder / "accuracy.png", folder / "heatmap.png"]
    accuracy_figure(results, paths[0])
    heatmap_figure(results, paths[1])
    return paths
