"""Running a sweep's cells on this machine: side by side, as many at once as its cores hold at
``nproc`` processes each, each an ordinary ``canon-titan train`` and then its scoring command.
Stopping the sweep (SIGTERM, Ctrl-C) stops its runs, which save the step they reached: the same
command continues, reusing every cell that finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from canon_titan.launch.ownership import torchrun_preexec
from canon_titan.sweep.cells import SCORES_FILE, Cell
from canon_titan.sweep.scores import Evaluation
from canon_titan.tools.fileio import write_atomic

TRAINED_FILE = "trained.json"
_SHOWN = ("progress:", "config error", "Traceback", "Error:", "error:")
"""A run's lines the sweep's own output repeats (the rest is in the cell's log)."""


BUSY_LOAD = 1.0
"""A 1-minute load average from which the machine is said to be busy: a core's worth of other work
(what installing a package just before leaves is less)."""


class RunFailed(Exception):
    pass


def default_jobs(cells: int, nproc: int) -> int:
    return max(1, min(cells, (os.cpu_count() or 1) // nproc))


def load_note(jobs: int, nproc: int) -> str | None:
    """A line saying the machine is busy (its 1-minute load average) when it is, since runs side by
    side are sized to free cores; None on an idle machine."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load < BUSY_LOAD:
        return None
    return (
        f"the machine is busy: load average {load:.1f} on {cores} cores before this sweep starts; "
        f"its {jobs} run(s) side by side want {jobs * nproc} free core(s), so they take longer "
        "than on an idle machine"
    )


def say(line: str) -> None:
    """One line of the sweep's output, whole (runs side by side print from their own threads)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _run(command: list[str], log: Path, name: str, env: dict) -> None:
    say(f"[{name}] + " + " ".join(command))
    with open(log, "a") as f:
        # SIGTERM the run when this process ends, however it ends: runs save, none is orphaned
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            preexec_fn=torchrun_preexec,
        )
        for line in proc.stdout:
            f.write(line)
            if any(mark in line for mark in _SHOWN):
                say(f"  [{name}] " + line.split(" - INFO - ")[-1].rstrip())
        if proc.wait():
            raise RunFailed(f"{name}: `{command[3]}` failed (exit {proc.returncode}); log: {log}")


def train_seconds(folder: Path) -> float | None:
    try:
        return json.loads((folder / TRAINED_FILE).read_text())["seconds"]
    except (OSError, ValueError, KeyError):
        return None


def run_cell(cell: Cell, evaluation: Evaluation, env: dict) -> dict:
    """Train (unless trained to its steps) and score (unless scored) one cell; its scores."""
    scores = evaluation.read_scores(cell.folder)
    if scores is not None:
        say(f"[sweep] {cell.name}: reusing {cell.folder / SCORES_FILE}")
        return scores
    step_dir = cell.trained_step()
    if step_dir is None:
        cell.write_record()
        started = time.monotonic()
        _run(cell.train_command(), cell.folder / "train.log", cell.name, env)
        write_atomic(
            cell.folder / TRAINED_FILE,
            json.dumps({"seconds": round(time.monotonic() - started, 1)}),
        )
        step_dir = cell.trained_step()
        if step_dir is None:
            raise RunFailed(
                f"{cell.name}: training ended without a checkpoint at step {cell.steps} "
                f"([checkpoint] enable must be on); log: {cell.folder / 'train.log'}"
            )
    else:
        say(f"[sweep] {cell.name}: trained ({step_dir}), scoring it")
    command = evaluation.command(cell.folder, step_dir)
    if command is not None:
        _run(command, cell.folder / "eval.log", cell.name, env)
    return evaluation.write_scores(cell.folder, train_seconds(cell.folder))


def run_local(cells: list[Cell], evaluation: Evaluation, jobs: int) -> list[dict]:
    """Every cell's scores, in order; RunFailed (once the runs going have ended) if one failed."""
    env = dict(os.environ)
    nproc = max(cell.nproc for cell in cells)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (jobs * nproc))))
    started, finished, lock = time.monotonic(), 0, threading.Lock()
    failed: list[str] = []

    def one(cell: Cell) -> dict | None:
        nonlocal finished
        if failed:  # a failed cell stops the sweep: start no other
            return None
        try:
            result = run_cell(cell, evaluation, env)
        except RunFailed as e:
            failed.append(str(e))
            return None
        with lock:
            finished += 1
            elapsed = time.monotonic() - started
            left = len(cells) - finished
            eta = (
                f", ETA {elapsed / finished * left / 60:.1f} min"
                if left and finished >= jobs
                else ""
            )
            say(
                f"[sweep] finished {finished}/{len(cells)}: {cell.name} "
                f"(elapsed {elapsed / 60:.1f} min{eta})"
            )
        return result

    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(one, cells))
    if failed:
        raise RunFailed("; ".join(failed))
    return results
