"""SIGTERM, SIGINT and SIGUSR1 in a training process: finish the step, save it, exit with PREEMPTED;
when the grace period runs out or a second signal comes first, exit at once with STOPPED (the step
reached is not on disk, so the exit must not read "saved, requeue").

A scheduler's preemption or time limit (SLURM sends SIGTERM, and with ``--signal=USR1@T`` SIGUSR1 a
chosen time early) and Ctrl-C all become a request to stop at the end of the current step; the ranks agree on
it through the per-step reduction the trainer already does. A checkpoint is complete only once its
``.metadata`` is written, so an exit in the middle of a save leaves the previous one the newest that loads.

The signals are taken by a thread, not by a Python signal handler: Python runs its handlers only
when the main thread comes back to the interpreter, and a rank blocked in a collective whose peer
never joins (or in any other C call) comes back only when that call times out. The C-level handler
writes each signal's number to a pipe (``signal.set_wakeup_fd``) whatever the main thread is doing; the
watcher thread reads it, starts the grace timer on the first signal and exits at once on a second.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from torchtitan.tools.logging import logger

from canon_titan.components.exit_codes import DUPLICATE_WINDOW_S, STOP_SIGNALS, STOPPED, exit_now



class Preempted(RuntimeError):
    pass


def _python_side(signum, frame) -> None:
    """The watcher thread acts on the signal; this handler only has to exist (a Python handler is what
    makes the C handler write to the wakeup pipe, and it keeps the default action away)."""


class StopSignals:
    def __init__(self, grace_seconds: int, on_disk: Callable[[], str] | None = None):
        """``on_disk`` says, when the process exits without saving, what is there to resume from."""
        self.grace_seconds = grace_seconds
        self.received_at: float | None = None
        self.on_disk = on_disk or (lambda: "nothing of this step was saved")

    def install(self) -> None:
        """Take the stop signals in a watcher thread (call from the main thread, as for any handler)."""
        read, write = os.pipe()
        os.set_blocking(write, False)  # the C handler must never block on a full pipe
        for sig in STOP_SIGNALS:
            signal.signal(sig, _python_side)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read,), name="stop-signals", daemon=True).start()

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def _watch(self, read: int) -> None:
        while True:
            for signum in os.read(read, 64):
                if signum in STOP_SIGNALS:
                    self._handle(signum)

    def _handle(self, signum: int) -> None:
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
            exit_now(STOPPED)  # not PREEMPTED: the step reached is not on disk

    def _out_of_time(self) -> None:
        logger.error(f"no checkpoint saved within [job] stop_grace_seconds = {self.grace_seconds}: exiting; "
                     f"{self.on_disk()}")
        exit_now(STOPPED)
