"""How the processes of a job stop on purpose and say so: the signals that ask a run to save and
stop, the exit codes of a process that stopped after one line saying why, and how a worker tells the
torchrun wrapper the code it ends with. Nothing heavy is imported here: the launcher and the torchrun
wrapper install ``stop_at_once_until_started`` before they import torch.

torchrun reports its workers' codes only when one fails; when torchrun itself got the stop signal it
raises instead, and the codes are lost. So each worker also writes its code to a file in a folder the
wrapper names (``OUTCOME_DIR_ENV``, a temporary folder on the local disk, never the dump folder,
which may be the full disk that stopped the run)."""

from __future__ import annotations

import atexit
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

REFUSED = 2  # a config error or a refusal before training (a live run, no loadable checkpoint, ...)
STOPPED = 3  # training stopped: divergence, a failed save
PREEMPTED = 75  # EX_TEMPFAIL, "try again": saved on SIGTERM/SIGINT/SIGUSR1; what a requeueing job script tests for
STOPPED_EXIT_CODES = {REFUSED, STOPPED, PREEMPTED}
OUTCOME_DIR_ENV = "CANON_TITAN_OUTCOME_DIR"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""What asks a run to save and stop (SIGUSR1's default action would kill the process on the spot)."""
DUPLICATE_WINDOW_S = 2.0
"""The same signal often comes twice at once (the scheduler signals every process, and torchrun passes
its own on to its workers): within this window it is one request."""


def stop_at_once_until_started(what: str) -> None:
    """Until a process has its own handlers: a stop signal ends it at once with one line and
    PREEMPTED (nothing has trained yet, so nothing is lost and a requeue runs it again) instead of a
    KeyboardInterrupt traceback or a silent death by signal."""

    def stop(signum, frame):
        os.write(2, f"canon-titan: {signal.Signals(signum).name} {what}: stopped, nothing to save; run the same "
                    f"command again\n".encode())
        exit_now(PREEMPTED)  # its cleanups too (a lease rank 0 already took)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def report_exit(code: int) -> int:
    """Record this worker's exit code for the torchrun wrapper (when it asked), and return it."""
    folder = os.environ.get(OUTCOME_DIR_ENV)
    if folder:
        try:
            Path(folder, f"rank-{os.environ.get('RANK', '0')}").write_text(str(code))
        except OSError:
            pass
    return code


def report_saved(step_dir: str | os.PathLike) -> None:
    """Record, for the torchrun wrapper, the checkpoint this worker saved before it stopped on a
    signal: the wrapper exits PREEMPTED only when that checkpoint is complete."""
    folder = os.environ.get(OUTCOME_DIR_ENV)
    if folder:
        try:
            Path(folder, f"saved-{os.environ.get('RANK', '0')}").write_text(os.fspath(step_dir))
        except OSError:
            pass


def saved_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """The checkpoints the workers said they saved before stopping."""
    saved = []
    for path in Path(folder).glob("saved-*"):
        try:
            saved.append(Path(path.read_text()))
        except OSError:
            pass
    return saved


def reported_exits(folder: str | os.PathLike) -> dict[int, int]:
    """Rank -> the exit code it reported."""
    codes = {}
    for path in Path(folder).glob("rank-*"):
        try:
            codes[int(path.name.split("-")[1])] = int(path.read_text())
        except (OSError, ValueError):
            pass
    return codes


_cleanups: list[Callable[[], None]] = []


def before_exit(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` however this process ends on purpose: at interpreter exit (atexit), and in
    ``exit_now`` (``os._exit`` skips atexit). It must be safe to run twice."""
    _cleanups.append(cleanup)
    atexit.register(cleanup)


def exit_now(code: int) -> NoReturn:
    """End the process at once, from any thread (the main one may be stuck in a collective): the
    ``before_exit`` cleanups, the code reported to the torchrun wrapper, then ``os._exit``."""
    for cleanup in reversed(_cleanups):
        try:
            cleanup()
        except Exception:  # a cleanup that fails must not keep the process alive
            pass
    os._exit(report_exit(code))
