"""Stand-ins for SLURM's ``srun`` and ``scontrol``, so that ``scripts/train.slurm`` runs on one
machine with its real command lines (``install`` puts them on a PATH folder).

``srun`` behaves as the real one does where the template depends on it (Slurm's src/srun/launch.c,
``_task_finish``): one task per node (``SLURM_NNODES``), each with its node's ``SLURM_NODEID`` and
``SLURM_STEP_ID``; with ``--kill-on-bad-exit=1`` the first task to end with a non-zero code or a
signal has every process of the other tasks sent SIGTERM, then SIGKILL after ``KILL_WAIT_S``
(slurmstepd's SIG_TERM_KILL over the step's processes); with ``--wait=N`` (and no kill on a bad
exit, which takes precedence) the tasks still running N seconds after the first ended are ended
alike; and its exit code is 128 + the highest signal when a task was killed by one, otherwise the
highest exit code.
``SRUN_SLOW_NODE_S`` makes every node but the first end that many seconds after its command does (a
slower node's teardown), so that a kill can land on a task that is still running, as it does at
scale.

``scontrol show hostnames`` prints two addresses of this machine, the second late (a reader that
stops at the first line is gone by then, which failed the template under pipefail); ``scontrol
requeue JOB`` appends JOB to the file ``requeued`` in the stand-ins' folder."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from proc_tree import descendants

KILL_WAIT_S = 5.0


def install(bin_dir: Path) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).write_text(
            f'#!/bin/sh\nSLURM_STANDIN_DIR="{bin_dir}" exec "{sys.executable}" '
            f'"{Path(__file__).resolve()}" {tool} "$@"\n'
        )
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def processes_under(pid: int) -> list[int]:
    """``pid`` and its live descendants (torchrun starts its workers in sessions of their own)."""
    return [pid, *descendants(pid)]


def _signal_task(task: subprocess.Popen, sig: int) -> None:
    for pid in processes_under(task.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def srun(argv: list[str]) -> int:
    options = []
    while argv and argv[0].startswith("--"):
        options.append(argv.pop(0))
    kill_on_bad_exit = "--kill-on-bad-exit=1" in options
    wait = next((float(o.split("=", 1)[1]) for o in options if o.startswith("--wait=")), 0.0)
    slow = os.environ.get("SRUN_SLOW_NODE_S", "0")
    tasks = []
    for node in range(int(os.environ["SLURM_NNODES"])):
        env = dict(
            os.environ,
            SLURM_NODEID=str(node),
            SLURM_PROCID=str(node),
            SLURM_LOCALID="0",
            SLURM_STEP_ID="0",
        )
        tasks.append(
            subprocess.Popen(
                [sys.executable, __file__, "task", slow if node else "0", *argv], env=env
            )
        )
    codes: dict[int, int] = {}
    killing_since = first_end = None
    while len(codes) < len(tasks):
        for node, task in enumerate(tasks):
            if node in codes or task.poll() is None:
                continue
            codes[node] = task.returncode
            first_end = first_end or time.monotonic()
            print(
                f"srun stand-in: node {node} ended with {task.returncode}",
                file=sys.stderr,
                flush=True,
            )
            if task.returncode != 0 and kill_on_bad_exit and killing_since is None:
                killing_since = time.monotonic()
                for other in tasks:
                    if other.poll() is None:
                        _signal_task(other, signal.SIGTERM)
        if wait and first_end and killing_since is None and time.monotonic() - first_end > wait:
            killing_since = time.monotonic()
            for other in tasks:
                if other.poll() is None:
                    _signal_task(other, signal.SIGTERM)
        if killing_since is not None and time.monotonic() - killing_since > KILL_WAIT_S:
            for task in tasks:
                if task.poll() is None:
                    _signal_task(task, signal.SIGKILL)
        time.sleep(0.05)
    signals = [-code for code in codes.values() if code < 0]
    return 128 + max(signals) if signals else max(codes.values())


def task(delay: str, argv: list[str]) -> int:
    code = subprocess.call(argv)
    time.sleep(float(delay))
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)  # ends as its command did, by the same signal
    return code


def scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        print("127.0.0.1", flush=True)
        time.sleep(0.5)
        print("127.0.0.2", flush=True)
        return 0
    if argv[0] == "requeue":
        with open(Path(os.environ["SLURM_STANDIN_DIR"]) / "requeued", "a") as f:
            f.write(f"{argv[1]}\n")
        return 0
    raise SystemExit(f"scontrol stand-in: unknown command {argv}")


if __name__ == "__main__":
    tool, args = sys.argv[1], sys.argv[2:]
    if tool == "task":
        sys.exit(task(args[0], args[1:]))
    sys.exit({"srun": srun, "scontrol": scontrol}[tool](args))
