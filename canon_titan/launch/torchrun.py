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
save and exit."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time

from canon_titan.components.exit_codes import (DUPLICATE_WINDOW_S, OUTCOME_DIR_ENV, STOP_SIGNALS,
                                               STOPPED_EXIT_CODES, reported_exits, stop_at_once_until_started)
from canon_titan.components.exit_codes import PREEMPTED as PREEMPTED_EXIT

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


def after_stop_signal(reported: dict[int, int]) -> int:
    """The job's code when torchrun got a stop signal: what its workers reported. A run that finished
    (every worker 0: the signal came during the last step, which was saved) is 0; one that stopped for
    another reason keeps its code; otherwise (saved, or no worker could say) 75."""
    codes = set(reported.values())
    if codes == {0}:
        return 0
    stopped = codes & (STOPPED_EXIT_CODES - {PREEMPTED_EXIT})
    return max(stopped) if stopped else PREEMPTED_EXIT


def main() -> int:
    # Imported here, after ``stop_at_once_until_started`` (importing torch takes seconds).
    from torch.distributed.elastic.multiprocessing import api as elastic_api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    # torchrun installs the module's handler by name when it starts its workers.
    elastic_api._terminate_process_handler = _terminate_once
    for sig in set(STOP_SIGNALS) - {signal.SIGTERM, signal.SIGINT}:  # the ones torchrun does not handle
        signal.signal(sig, _stop_as_sigterm)
    outcomes = tempfile.mkdtemp(prefix="canon-titan-exits-")
    os.environ[OUTCOME_DIR_ENV] = outcomes  # the workers inherit it
    try:
        torchrun_main()
    except SignalException:  # its workers got the signal too, and saved, finished or ran out of time
        return after_stop_signal(reported_exits(outcomes))
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        # Once one worker exits, torchrun stops the others with SIGTERM (or SIGKILL, late ones).
        stopped = codes & STOPPED_EXIT_CODES
        if not stopped or not codes <= STOPPED_EXIT_CODES | {-signal.SIGTERM, -signal.SIGKILL}:
            raise
        return max(stopped)
    finally:
        shutil.rmtree(outcomes, ignore_errors=True)
    return 0


if __name__ == "__main__":
    stop_at_once_until_started("before the training processes started")
    sys.exit(main())
