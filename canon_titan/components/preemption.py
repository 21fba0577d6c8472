"""SIGTERM, SIGINT and SIGUSR1 in a training process: finish the step, save it, exit with PREEMPTED_EXIT.

A scheduler's preemption or time limit (SLURM sends SIGTERM, and with ``--signal=USR1@T`` SIGUSR1 a
chosen time early) and Ctrl-C all become a request to stop at the end of the current step; the ranks agree on
it through the per-step reduction the trainer already does. The grace period is enforced from a
thread (the main thread may be inside a long collective): when it runs out the process exits at
once, and so it does on a second signal. A checkpoint is complete only once its ``.metadata`` is
written, so an exit in the middle of a save leaves the previous one the newest that loads.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from torchtitan.tools.logging import logger

from canon_titan.components.exit_codes import DUPLICATE_WINDOW_S, STOP_SIGNALS, report_exit
from canon_titan.components.exit_codes import PREEMPTED as PREEMPTED_EXIT



class Preempted(RuntimeError):
    pass


class StopSignals:
    def __init__(self, grace_seconds: int, on_disk: Callable[[], str] | None = None):
        """``on_disk`` says, when the process exits without saving, what is there to resume from."""
        self.grace_seconds = grace_seconds
        self.received_at: float | None = None
        self.on_disk = on_disk or (lambda: "nothing of this step was saved")

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self.received_at is None:
            self.received_at = now
            timer = threading.Timer(self.grace_seconds, self._out_of_time)
            timer.daemon = True
            timer.start()
            logger.warning(f"{name} received: finishing this step and saving a checkpoint (at most "
                           f"{self.grace_seconds} s, [job] stop_grace_seconds; a second signal exits at once)")
        elif now - self.received_at > DUPLICATE_WINDOW_S:
            logger.error(f"second {name}: exiting without saving this step; {self.on_disk()}")
            os._exit(report_exit(PREEMPTED_EXIT))

    def _out_of_time(self) -> None:
        logger.error(f"no checkpoint saved within [job] stop_grace_seconds = {self.grace_seconds}: exiting; "
                     f"{self.on_disk()}")
        os._exit(report_exit(PREEMPTED_EXIT))
