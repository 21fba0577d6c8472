"""Training curves of several runs side by side: ``canon-titan report RUN_DIR ... --out F.png``.

Each run is a dump folder with TensorBoard events (``[metrics] enable_tensorboard``), or a sweep's
folder (``canon-titan sweep``), which stands for its cells, one colour per arm. One panel shows the
training loss, one the validation loss (``[validation]``), one panel each the evaluation metrics
logged during training (``[eval]``), all against tokens seen, one colour per run. ``--html`` also
writes a self-contained page: the figure inline plus a table of each run's last values.
"""

from __future__ import annotations

import base64
import html
import io
import tomllib
from dataclasses import dataclass
from pathlib import Path

from canon_titan.components.metrics import LOSS_TAG, VALIDATION_TAG, read_all_scalars
from canon_titan.tools.fileio import write_atomic

TOKENS_TAG = "n_tokens_seen"
MAX_PANELS = 16
# Per-evaluation bookkeeping, not a score worth a panel.
_NOT_PLOTTED = ("eval/seconds", "/items")
# Fractions in the logs, shown in percent as `eval synthetic` and `eval lm` print them.
_PERCENT = ("/accuracy", "/acc", "/acc_norm", "/exact_match")


LOSSES = {LOSS_TAG: "training loss", VALIDATION_TAG: "validation loss"}
"""The loss panels, first, by title."""


def is_percent(tag: str) -> bool:
    return tag.endswith(_PERCENT)


def shown_value(tag: str, value: float) -> float:
    return 100 * value if is_percent(tag) else value


class ReportError(ValueError):
    pass


@dataclass
class RunCurves:
    label: str
    folder: Path
    series: dict[str, dict[int, float]]
    """tag -> step -> value"""
    tokens: dict[int, float]
    colour_key: str | None = None
    """Runs with the same key share a colour (a sweep's arm); None: a colour of its own."""

    def tokens_at(self, steps: list[int]) -> list[float]:
        """Tokens seen after each step, interpolated between the steps where they were logged."""
        import numpy as np

        known = sorted(self.tokens.items())
        if not known:
            return [float(s) for s in steps]
        xs, ys = [0] + [s for s, _ in known], [0.0] + [t for _, t in known]
        per_step = ys[-1] / xs[-1] if xs[-1] else 1.0
        return [
            float(np.interp(s, xs, ys)) if s <= xs[-1] else ys[-1] + (s - xs[-1]) * per_step
            for s in steps
        ]


def read_run(run_dir: str | Path, label: str | None = None) -> RunCurves:
    run_dir = Path(run_dir)
    config_file = run_dir / "run_config.toml"
    config = tomllib.loads(config_file.read_text()) if config_file.is_file() else {}
    tb = config.get("metrics", {}).get("save_tb_folder", "tb")
    series = read_all_scalars(str(run_dir), tb)
    if not series:
        raise ReportError(
            f"{run_dir}: no TensorBoard event files under {run_dir / tb} "
            "(was [metrics] enable_tensorboard on?)"
        )
    label = label or config.get("job", {}).get("description") or run_dir.name
    return RunCurves(label, run_dir, series, series.pop(TOKENS_TAG, {}))


def panels(runs: list[RunCurves]) -> list[str]:
    """The training and validation losses, then every eval metric any run logged (first
    MAX_PANELS)."""
    tags = sorted(
        {
            t
            for r in runs
            for t in r.series
            if t.startswith("eval/") and not any(x in t for x in _NOT_PLOTTED)
        }
    )
    losses = [tag for tag in LOSSES if any(tag in r.series for r in runs)]
    return losses + tags[: MAX_PANELS - len(losses)]


def _ema(values: list[float], alpha: float) -> list[float]:
    """Exponential moving average, debiased as TensorBoard's smoothing slider is (no pull
    towards the first value)."""
    out, current = [], 0.0
    for i, v in enumerate(values, 1):
        current = alpha * current + (1 - alpha) * v
        out.append(current / (1 - alpha**i))
    return out


def figure(runs: list[RunCurves], smooth: float = 0.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tags = panels(runs)
    if not tags:
        raise ReportError("the runs logged neither a training loss nor eval metrics")
    cols = min(3, len(tags))
    rows = -(-len(tags) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    keys = list(dict.fromkeys(run.colour_key or run.label for run in runs))
    for ax, tag in zip(axes.flat, tags):
        for _i, run in enumerate(runs):
            points = sorted(run.series.get(tag, {}).items())
            if not points:
                continue
            steps, values = zip(*points)
            values = _ema(list(values), smooth) if tag == LOSS_TAG and smooth else list(values)
            # Markers wherever points are few: a run that logged its loss once is still visible.
            marker = "o" if tag != LOSS_TAG or len(points) <= 30 else None
            colour = colours[keys.index(run.colour_key or run.label) % len(colours)]
            ax.plot(
                run.tokens_at(list(steps)),
                [shown_value(tag, v) for v in values],
                color=colour,
                marker=marker,
                markersize=3,
                label=run.label,
            )
        name = tag.removeprefix("eval/")
        ax.set_title(LOSSES.get(tag, name), fontsize=10)
        ax.set_xlabel("tokens")
        unit = f"{name.rsplit('/', 1)[-1]}{' (%)' if is_percent(tag) else ''}"
        ax.set_ylabel("loss" if tag in LOSSES else unit)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tags) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def last_values(runs: list[RunCurves]) -> tuple[list[str], list[list[str]]]:
    """Per run: its last logged step, tokens seen then, and each metric's value at its own last
    logged step (the step in parentheses when it is not the run's last)."""
    tags = panels(runs)
    rows = []
    for run in runs:
        last_step = max((max(points) for points in run.series.values() if points), default=0)
        row = [run.label, f"{last_step:,}", f"{run.tokens_at([last_step])[0]:,.0f}"]
        for tag in tags:
            points = run.series.get(tag)
            if not points:
                row.append("")
                continue
            step = max(points)
            row.append(
                f"{shown_value(tag, points[step]):.4g}"
                + (f" (step {step:,})" if step != last_step else "")
            )
        rows.append(row)
    names = [t.removeprefix("eval/") + (" (%)" if is_percent(t) else "") for t in tags]
    columns = {LOSS_TAG: "loss", VALIDATION_TAG: "validation loss"}
    return ["run", "last step", "tokens", *(columns.get(n, n) for n in names)], rows


def write_report(
    run_dirs: list[str],
    out_png: str | Path,
    html_path: str | Path | None = None,
    labels: list[str] | None = None,
    smooth: float = 0.0,
) -> list[RunCurves]:
    if labels is not None and len(labels) != len(run_dirs):
        raise ReportError(f"--labels has {len(labels)} names for {len(run_dirs)} runs")
    runs = []
    for i, folder in enumerate(run_dirs):
        cells = sweep_cells(folder)
        if cells is None:
            runs.append(read_run(folder, labels[i] if labels else None))
        else:
            runs += cells
    names = [r.label for r in runs]
    for run in runs:
        if names.count(run.label) > 1:  # two runs with one description: tell them apart by folder
            run.label = f"{run.label} ({run.folder.name})"
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig = figure(runs, smooth)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    png = buffer.getvalue()
    write_atomic(Path(out_png), png)
    if html_path:
        header, rows = last_values(runs)
        cells = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
        )
        folders = "".join(
            f"<li>{html.escape(r.label)}: <code>{html.escape(str(r.folder))}</code></li>"
            for r in runs
        )
        page = (
            "<!doctype html><html><head><meta charset='utf-8'><title>canon-titan report</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px "
            "8px;text-align:right}td:first-child{text-align:left}</style>"
            "</head><body><h1>canon-titan report</h1>"
            "<img alt='training curves' "
            f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
            f"<h2>Last logged values</h2><table><tr>{cells}</tr>{body}</table>"
            f"<h2>Runs</h2><ul>{folders}</ul></body></html>\n"
        )
        Path(html_path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(html_path), page)
    return runs


def sweep_cells(folder: str | Path) -> list[RunCurves] | None:
    """The cells of the sweep in ``folder`` that have curves, labelled by arm and seed and coloured
    by arm (None: not a sweep's folder)."""
    import json

    manifest = Path(folder) / "sweep.json"
    if not manifest.is_file():
        return None
    cells = json.loads(manifest.read_text())["cells"]
    several = len({c["task"] for c in cells}) > 1
    runs = []
    for cell in cells:
        arm = f"{cell['task']} {cell['arm']}" if several else cell["arm"]
        try:
            run = read_run(cell["folder"], f"{arm} seed {cell['seed']}")
        except ReportError:  # not started yet
            continue
        run.colour_key = arm
        runs.append(run)
    if not runs:
        raise ReportError(f"{folder}: a sweep none of whose cells has TensorBoard events yet")
    return runs
