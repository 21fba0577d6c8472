"""``python -m canon_titan.torchrun ARGS``: torchrun (``torch.distributed.run``) as the launcher
runs it. A job that stops on purpose (preempted, diverged, refused: its rank 0 has already said why
in one line) exits with its ranks' code instead of torchrun's failure report and traceback; any
other failure keeps torchrun's report."""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from canon_titan.exit_codes import STOPPED_EXIT_CODES
from canon_titan.preemption import PREEMPTED_EXIT


def main() -> int:
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
