"""A sweep as one SLURM job array: ``canon-titan sweep SPEC --slurm`` writes a manifest (a line a
cell) and an ``sbatch --array`` script under ``[sweep] out``/slurm. Each array task runs
``python -m canon_titan.sweep.slurm MANIFEST INDEX``: it trains its cell with
``scripts/train.slurm`` (a preempted task saves, is requeued by it and resumes, as any run), scores
it on its first node and writes its ``scores.json``; a cell already scored is left as it is, one
trained is only scored. ``canon-titan sweep SPEC --collect`` then gathers what has finished.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from canon_titan.sweep.cells import CELL_FILE, Cell, trained_step
from canon_titan.sweep.scores import Evaluation, from_settings
from canon_titan.sweep.spec import Spec, SweepError
from canon_titan.tools.fileio import write_atomic

TRAIN_SLURM = Path(__file__).resolve().parents[2] / "scripts" / "train.slurm"
_OWN = ("--job-name", "--nodes", "--output", "--gpus-per-node", "--array")
"""train.slurm's ``#SBATCH`` options the array script sets itself."""


def manifest_line(cell: Cell, evaluation: Evaluation) -> str:
    return json.dumps(
        {
            "folder": str(cell.folder),
            "name": cell.name,
            "steps": cell.steps,
            "record": cell.record(),
            "config": cell.task.config,
            "train": cell.train_args(),
            "eval": evaluation.settings(),
        }
    )


def array_script(spec: Spec, manifest: Path, count: int) -> str:
    """train.slurm's options (one task a node, its stop signal and requeue), the spec's nodes and
    GPUs, an array of ``count`` tasks, each running its cell."""
    if not TRAIN_SLURM.is_file():
        raise SweepError(
            f"--slurm: no {TRAIN_SLURM} (the array tasks run it): install canon-titan "
            "from its repository (pip install -e .)"
        )
    kept = [
        line
        for line in TRAIN_SLURM.read_text().splitlines()
        if line.startswith("#SBATCH") and line.split()[1].split("=")[0] not in _OWN
    ]
    logs = manifest.parent
    return "\n".join(
        [
            "#!/bin/bash",
            f"# canon-titan sweep {spec.name} ({spec.path}): a cell a task, listed in {manifest}.",
            "# Each task trains its cell with scripts/train.slurm (a preemption saves the "
            "step reached",
            "# and requeues the task, which resumes), then scores it. Submit from the "
            "folder the sweep",
            f"# was made in: sbatch {logs / 'sweep.sbatch'}; then canon-titan sweep ... --collect",
            f"#SBATCH --job-name=sweep-{spec.name}",
            f"#SBATCH --nodes={spec.slurm_nodes}",
            f"#SBATCH --gpus-per-node={spec.slurm_gpus_per_node}",
            *kept,
            f"#SBATCH --array=0-{count - 1}",
            f"#SBATCH --output={logs}/%A_%a.out",
            "set -euo pipefail",
            'cd "${SLURM_SUBMIT_DIR}"',
            'TASK=${SLURM_ARRAY_TASK_ID:?"not an array task: sbatch --array sets '
            'SLURM_ARRAY_TASK_ID"}',
            'exec "${PYTHON:-.venv/bin/python}" -m canon_titan.sweep.slurm '
            f'{shlex.quote(str(manifest))} "$TASK"',
            "",
        ]
    )


def manifest_of(spec: Spec) -> Path:
    return spec.out / "slurm" / "manifest.jsonl"


def write(spec: Spec, cells: list[Cell], evaluation: Evaluation) -> Path:
    manifest = manifest_of(spec)
    script = manifest.parent / "sweep.sbatch"
    text = array_script(spec, manifest, len(cells))
    write_atomic(manifest, "".join(manifest_line(cell, evaluation) + "\n" for cell in cells))
    write_atomic(script, text)
    script.chmod(0o755)
    return script


def run_task(entry: dict) -> int:
    """One array task: its cell trained (unless it is), scored (unless it is). The exit status of
    a training that did not finish (75: preempted, requeued by train.slurm) is the task's."""
    folder, evaluation, name = Path(entry["folder"]), from_settings(entry["eval"]), entry["name"]
    if evaluation.read_scores(folder):
        print(f"canon-titan sweep: {name} is scored already ({folder})", flush=True)
        return 0
    if trained_step(folder, entry["steps"]) is None:
        write_atomic(folder / CELL_FILE, json.dumps(entry["record"], indent=2) + "\n")
        code = subprocess.call(["bash", str(TRAIN_SLURM), entry["config"], *entry["train"]])
        if code:
            return code
    step_dir = trained_step(folder, entry["steps"])
    if step_dir is None:
        print(
            f"canon-titan sweep: {name}: training ended without a checkpoint at step "
            f"{entry['steps']} in {folder}",
            file=sys.stderr,
        )
        return 1
    command = evaluation.command(folder, step_dir)
    if command is not None:
        code = subprocess.call(command)
        if code:
            return code
    evaluation.write_scores(folder, None)
    print(f"canon-titan sweep: {name}: scored ({folder})", flush=True)
    return 0


def main(argv: list[str]) -> int:
    manifest, index = argv
    return run_task(json.loads(Path(manifest).read_text().splitlines()[int(index)]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
