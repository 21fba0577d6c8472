"""``python -m canon_titan.launch.torchrun ARGS``: torchrun (``torch.distributed.run``) as the launcher
runs it. A job that stops on purpose (preempted, diverged, refused: its rank 0 has already said why
in one line) exits with its ranks' code instead of torchrun's failure report and traceback; any
other failure keeps torchrun's report.

A stop signal often reaches torchrun twice at once: Ctrl-C or ``kill -- -PGID`` signals the
launcher's whole process group, and the launcher passes its own on. torchrun's handler raises on
each, so the copy lands inside its shutdown (a logging traceback, or a wait for the saving workers
cut short). Copies within the workers' duplicate window count as one, as they do in the workers;
a later signal still stops everything at once."""

from __future__ import annotations

import os
import signal
import sys
import time

from torch.distributed.elastic.multiprocessing import api as elastic_api
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from canon_titan.components.exit_codes import STOPPED_EXIT_CODES
from canon_titan.components.preemption import DUPLICATE_WINDOW_S, PREEMPTED_EXIT

_first_signal_at: list[float] = []


def _terminate_once(signum, frame) -> None:
    """torchrun's death-signal handler, raising once per stop request."""
    now = time.monotonic()
    if _first_signal_at and now - _first_signal_at[0] <= DUPLICATE_WINDOW_S:
        return
    _first_signal_at[:] = [now]
    raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals(signum)}",
                          sigval=signal.Signals(signum))


def main() -> int:
    # torchrun installs the module's handler by name when it starts its workers.
    elastic_api._terminate_process_handler = _terminate_once
    try:
        torchrun_main()
    except SignalException:  # its workers got the signal too, and saved or ran out of time
        return PREEMPTED_EXIT
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        # Once one worker exits, torchrun stops the others with SIGTERM (or SIGKILL, late ones).
        stopped = codes & STOPPED_EXIT_CODES
        if not stopped or not codes <= STOPPED_EXIT_CODES | {-signal.SIGTERM, -signal.SIGKILL}:
            raise
        return max(stopped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
