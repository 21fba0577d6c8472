"""``python -m canon_titan.launch.torchrun ARGS``: torchrun (``torch.distributed.run``) as the launcher
runs it. A job that stops on purpose (preempted, diverged, refused: its rank 0 has already said why
in one line) exits with its ranks' code instead of torchrun's failure report and traceback; any
other failure keeps torchrun's report.

A stop signal often reaches torchrun twice at once: Ctrl-C or ``kill -- -PGID`` signals the
launcher's whole process group, and the launcher passes its own on. torchrun's handler raises on
each, so the copy lands inside its shutdown (a logging traceback, or a wait for the saving workers
cut short). Copies within the workers' duplicate window count as one, as they do in the workers;
a later signal still stops everything at once. SIGUSR1 (SLURM's ``--signal=USR1@T``), which torchrun
does not handle and which would kill it on the spot, is taken as SIGTERM: the workers get SIGTERM,
save and exit.

Exit codes: 0, 2 (refused before training), 3 (stopped: divergence, a failed save, or a stop signal
that left no complete checkpoint of the step reached) and 75 only when the workers saved the step
they reached and that checkpoint is complete, so a requeue-on-75 job script resumes exactly.

What ``canon-titan train`` sets, the wrapper defaults to when it is not given: ``--log-dir`` (torchrun's
per-rank copies of the output, on the local temporary disk, never the dump folder) and
``--shutdown-timeout`` (the run's ``[job] stop_grace_seconds`` plus 30 s, so the workers have the
time to save that the config gives them)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from canon_titan.components.exit_codes import (DUPLICATE_WINDOW_S, OUTCOME_DIR_ENV, PREEMPTED, STOP_SIGNALS,
                                               STOPPED, STOPPED_EXIT_CODES, reported_exits, saved_checkpoints,
                                               stop_at_once_until_started)

TRAINING_MODULE = "canon_titan.train"
SHUTDOWN_MARGIN_S = 30
"""Beyond the run's stop grace: the workers' exit, torchrun's own shutdown."""

_first_signal_at: list[float] = []


def _terminate_once(signum, frame) -> None:
    """torchrun's death-signal handler, raising once per stop request."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    now = time.monotonic()
    if _first_signal_at and now - _first_signal_at[0] <= DUPLICATE_WINDOW_S:
        return
    _first_signal_at[:] = [now]
    raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals(signum)}",
                          sigval=signal.Signals(signum))


def _stop_as_sigterm(signum, frame) -> None:
    _terminate_once(signal.SIGTERM, frame)


def after_stop_signal(reported: dict[int, int], saved: list[Path]) -> int:
    """The job's code when torchrun got a stop signal: what its workers reported. A run that finished
    (every worker 0: the signal came during the last step, which was saved) is 0; one that stopped for
    another reason keeps its code (3 where the step reached is not on disk: the grace period ran out,
    a second signal, checkpointing off); 75 when the workers said so (they saved the step reached, or
    had not started training) and every checkpoint they said they saved is complete; workers that
    could not say (killed) are 3."""
    codes = set(reported.values())
    if not codes:
        return STOPPED
    if codes == {0}:
        return 0
    stopped = codes & (STOPPED_EXIT_CODES - {PREEMPTED})
    if stopped:
        return max(stopped)
    return PREEMPTED if _complete(saved) else STOPPED


def _complete(saved: list[Path]) -> bool:
    return all((step_dir / ".metadata").is_file() for step_dir in saved)


class _PurposefulStops(logging.Filter):
    """torchrun's lines about a worker that stopped on purpose (its rank has said why in one line,
    which must stay the last thing on screen): ``failed (exitcode: 3)`` and the error-file line that
    follows it; any other failure keeps them, and torchrun's report. Its ``Sending process N closing
    signal SIGTERM``, logged as it stops the other workers and before it logs why, goes too: it
    names pids, not a cause.

    torchrun names the failure with the earliest timestamp, and a worker it stopped with SIGTERM or
    SIGKILL can hold an earlier one than the rank that stopped on purpose (an error file written
    while it was still exiting, on a loaded machine). Such a line goes too when a worker has
    reported a purposeful stop to ``outcomes`` (the folder the workers report their exit codes to),
    as ``main`` then exits with that worker's code."""

    def __init__(self, outcomes: str | None = None):
        super().__init__()
        self.seen = False
        self.outcomes = outcomes

    def _stopped_on_purpose(self, exitcode) -> bool:
        if exitcode in STOPPED_EXIT_CODES:
            return True
        if exitcode not in (-signal.SIGTERM, -signal.SIGKILL) or not self.outcomes:
            return False
        return any(code in STOPPED_EXIT_CODES for code in reported_exits(self.outcomes).values())

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        if message.startswith("Sending process %s closing signal"):
            return False
        if message.startswith("failed (exitcode: %s)") and record.args and self._stopped_on_purpose(record.args[0]):
            self.seen = True
            return False
        return not (self.seen and message.startswith("no error file defined"))


def with_defaults(argv: list[str]) -> tuple[list[str], str | None]:
    """torchrun's arguments, with ``--log-dir`` and ``--shutdown-timeout`` added where they are not
    given and the job runs ``canon_titan.train``; and the log folder made here (None if none)."""
    try:
        module = next(i for i in range(1, len(argv)) if argv[i] == TRAINING_MODULE and argv[i - 1] in ("-m", "--module"))
    except StopIteration:
        return argv, None
    launcher, training = argv[:module - 1], argv[module - 1:]
    given = {arg.split("=")[0].replace("_", "-") for arg in launcher if arg.startswith("--")}
    added, own_log_dir = [], None
    if "--log-dir" not in given:
        own_log_dir = tempfile.mkdtemp(prefix="torchelastic_")
        added += ["--log-dir", own_log_dir]
    grace = _stop_grace_seconds(training[2:])
    if "--shutdown-timeout" not in given and grace is not None:
        added += ["--shutdown-timeout", str(grace + SHUTDOWN_MARGIN_S)]
    return [*launcher, *added, *training], own_log_dir


def _stop_grace_seconds(training_args: list[str]) -> int | None:
    """The run's ``[job] stop_grace_seconds``, or None when its config does not load (the workers
    say why, once)."""
    from canon_titan.config import ConfigError, load

    if "--config" not in training_args[:-1]:
        return None
    at = training_args.index("--config")
    try:
        run = load(training_args[at + 1], training_args[:at] + training_args[at + 2:], environment=False)
    except ConfigError:
        return None
    return run["job"]["stop_grace_seconds"]


def main(argv: list[str] | None = None) -> int:
    from canon_titan.tools.startup import importing

    # Imported here, after ``stop_at_once_until_started`` (importing torch takes seconds).
    with importing():
        from torch.distributed.elastic.multiprocessing import api as elastic_api
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun_main

    argv, own_log_dir = with_defaults(sys.argv[1:] if argv is None else argv)
    # torchrun installs the module's handler by name when it starts its workers.
    elastic_api._terminate_process_handler = _terminate_once
    for sig in set(STOP_SIGNALS) - {signal.SIGTERM, signal.SIGINT}:  # the ones torchrun does not handle
        signal.signal(sig, _stop_as_sigterm)
    outcomes = tempfile.mkdtemp(prefix="canon-titan-exits-")
    os.environ[OUTCOME_DIR_ENV] = outcomes  # the workers inherit it
    quiet = _PurposefulStops(outcomes)
    for name in ("torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.multiprocessing.errors.error_handler"):
        logging.getLogger(name).addFilter(quiet)
    code = None
    try:
        torchrun_main(argv)
        code = 0
    except SignalException:  # its workers got the signal too, and saved, finished or ran out of time
        reported = reported_exits(outcomes)
        code = after_stop_signal(reported, saved_checkpoints(outcomes))
        if not reported:
            print("canon-titan: the training processes were stopped before they could save the step they reached; "
                  "the same command resumes from the newest complete checkpoint", file=sys.stderr)
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        # Once one worker exits, torchrun stops the others with SIGTERM (or SIGKILL, late ones).
        stopped = codes & STOPPED_EXIT_CODES
        if not stopped or not codes <= STOPPED_EXIT_CODES | {-signal.SIGTERM, -signal.SIGKILL}:
            raise
        code = max(stopped)
        if code == PREEMPTED and not _complete(saved_checkpoints(outcomes)):
            code = STOPPED
    finally:
        shutil.rmtree(outcomes, ignore_errors=True)
        if code in (0, *STOPPED_EXIT_CODES) and own_log_dir:  # each rank said why; else torchrun named the files
            shutil.rmtree(own_log_dir, ignore_errors=True)
    return code


if __name__ == "__main__":
    stop_at_once_until_started("before the training processes started")
    sys.exit(main())
