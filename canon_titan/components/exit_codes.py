"""How the processes of a job stop on purpose and say so: the signals that ask a run to save and
stop, the exit codes of a process that stopped after one line saying why, and how a worker tells the
torchrun wrapper the code it ends with. Nothing heavy is imported here: the launcher, the torchrun
wrapper and the training processes take the stop signals (``take_stop_signals``) before they import
torch.

torchrun reports its workers' codes only when one fails; when torchrun itself got the stop signal it
raises instead, and the codes are lost. So each worker also writes its code to a file in a folder
the wrapper names (``OUTCOME_DIR_ENV``, a temporary folder on the local disk, never the dump folder,
which may be the full disk that stopped the run), with whether it has started training and the line
it stops with (``say_once``), which the wrapper prints once for its node.

Signals are taken by a thread (``take_stop_signals``), not by a Python signal handler: Python runs
its handlers only when the main thread comes back to the interpreter, and a process blocked in a C
call (a TCPStore connecting to a node that does not answer, a collective whose peer never joins)
comes back only when that call times out. The C-level handler writes each signal's number to a pipe
(``signal.set_wakeup_fd``) whatever the main thread is doing; the thread reads it."""

from __future__ import annotations

import atexit
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

REFUSED = 2  # a config error or a refusal before training (a live run, no loadable checkpoint, ...)
STOPPED = 3  # training stopped: divergence, a failed save
# EX_TEMPFAIL, "try again": saved on SIGTERM/SIGINT/SIGUSR1; what a requeueing job script tests for
PREEMPTED = 75
STOPPED_EXIT_CODES = {REFUSED, STOPPED, PREEMPTED}
OUTCOME_DIR_ENV = "CANON_TITAN_OUTCOME_DIR"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""What asks a run to save and stop (SIGUSR1's default action would kill the process on the
spot)."""
DUPLICATE_WINDOW_S = 2.0
"""The same signal often comes twice at once (the scheduler signals every process, and torchrun
passes its own on to its workers): within this window it is one request."""


def _python_side(signum, frame) -> None:
    """The watcher thread acts on the signal; this handler only has to exist (a Python handler is
    what makes the C handler write to the wakeup pipe, and it keeps the default action away)."""


_act: list[Callable[[int], None]] = []
_reported: list[int] = []
"""The code this process reported it exits with (``report_exit``), once it did."""
_said: list[str] = []
"""The line this process said (``say_once``), once it did."""
_watching: list[threading.Thread] = []


def take_stop_signals(act: Callable[[int], None]) -> None:
    """From now on each stop signal calls ``act(signum)`` on the watcher thread, whatever the main
    thread is doing (call from the main thread, as for any handler). The first call starts the
    watcher; a later one changes what it does. A signal whose handler another owner has installed
    since (torchrun's, or a launcher's that passes it on) is that owner's: the watcher leaves it
    alone."""
    _act[:] = [act]
    for sig in STOP_SIGNALS:
        signal.signal(sig, _python_side)
    if not _watching:
        read, write = os.pipe()
        os.set_blocking(write, False)  # the C handler must never block on a full pipe
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        _watching.append(
            threading.Thread(target=_watch, args=(read,), name="stop-signals", daemon=True)
        )
        _watching[0].start()


def _watch(read: int) -> None:
    while True:
        for signum in os.read(read, 64):
            if signum in STOP_SIGNALS and watching(signum):
                _act[0](signum)


def watching(signum: int) -> bool:
    """Whether ``take_stop_signals``' watcher has ``signum`` (no other owner has installed a handler
    since)."""
    return signal.getsignal(signum) is _python_side


def stop_at_once_until_started(what: str) -> None:
    """Until a launcher has its own handlers: a stop signal ends it at once with one line and
    PREEMPTED (nothing has trained yet, so nothing is lost and a requeue runs it again) instead of a
    KeyboardInterrupt traceback or a silent death by signal, even inside a C call."""

    def stop(signum):
        os.write(
            2,
            f"canon-titan: {signal.Signals(signum).name} {what}: stopped, nothing to save; "
            "run the same "
            f"command again\n".encode(),
        )
        exit_now(PREEMPTED)  # its cleanups too (a lease rank 0 already took)

    take_stop_signals(stop)


def stop_before_training() -> None:
    """In a training process, until its trainer takes the stop signals (once its first step is
    done): a stop signal ends it at once with PREEMPTED, its line said once (``say_once``). Nothing
    has trained, so nothing is lost, and every rank stops alike wherever it is (importing torch,
    waiting for its peers, building the model, loading a checkpoint): none is left waiting for one
    that has gone."""

    def stop(signum):
        if _reported:  # it was already ending with its own code and line (the agent stops the
            exit_now(_reported[0])  # ranks still shutting down once one has exited): keep them
        say_once(
            f"{signal.Signals(signum).name} before training started: stopped, nothing to "
            "save; run the same "
            "command again"
        )
        exit_now(PREEMPTED)

    take_stop_signals(stop)


def _rank() -> str:
    return os.environ.get("RANK", "0")


def say_once(message: str) -> None:
    """A line every rank of the job says alike (a refusal, why it stopped), shown once on each node:
    under the torchrun wrapper, handed to it (it prints its node's lines after torchrun ends, so the
    line is the last one on the console, whichever ranks' output torchrun shows); otherwise printed
    by the node's first rank."""
    if _said:  # its first line is why it ends (a stop signal during its shutdown keeps it)
        return
    _said.append(message)
    folder = os.environ.get(OUTCOME_DIR_ENV)
    if folder:
        try:
            Path(folder, f"line-{_rank()}").write_text(message)
            return
        except OSError:
            pass
    if os.environ.get("LOCAL_RANK", _rank()) == "0":
        os.write(2, f"canon-titan: {message}\n".encode())


def reported_lines(folder: str | os.PathLike) -> list[str]:
    """The workers' ``say_once`` lines, each once, in the order of their ranks."""
    lines = []
    for path in sorted(Path(folder).glob("line-*"), key=lambda p: int(p.name.split("-")[1])):
        try:
            line = path.read_text()
        except OSError:
            continue
        if line not in lines:
            lines.append(line)
    return lines


def report_training() -> None:
    """Record, for the torchrun wrapper, that this worker has trained a step: from then on a stop
    signal finishes and saves the step reached rather than ending the process at once."""
    folder = os.environ.get(OUTCOME_DIR_ENV)
    if folder:
        try:
            Path(folder, f"training-{_rank()}").touch()
        except OSError:
            pass


def trained(folder: str | os.PathLike) -> bool:
    """Whether any worker said it had trained a step."""
    return any(Path(folder).glob("training-*"))


def report_exit(code: int) -> int:
    """Record this worker's exit code for the torchrun wrapper (when it asked), and return it."""
    _reported[:] = [code]
    folder = os.environ.get(OUTCOME_DIR_ENV)
    if folder:
        try:
            Path(folder, f"rank-{_rank()}").write_text(str(code))
        except OSError:
            pass
    return code


def report_saved(step_dir: str | os.PathLike) -> None:
    """Record, for the torchrun wrapper, the checkpoint this worker saved before it stopped on a
    signal: the wrapper exits PREEMPTED only when that checkpoint is complete."""
    folder = os.environ.get(OUTCOME_DIR_ENV)
    if folder:
        try:
            Path(folder, f"saved-{_rank()}").write_text(os.fspath(step_dir))
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
