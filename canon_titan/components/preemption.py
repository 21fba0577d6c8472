"""SIGTERM, SIGINT and SIGUSR1 in a training process that has trained: finish the step, save it,
exit with PREEMPTED; when the grace period runs out or a second signal comes first, exit at once
with STOPPED (the step reached is not on disk, so the exit must not read "saved, requeue"). Before
its first step starts a training process stops at once instead
(``exit_codes.stop_before_training``): there is nothing to save, and a rank that waited for a step's
end would wait for peers that have gone. The trainer takes the signals before its first step's first
collective, and tells the torchrun wrapper that it trained only once that step is done: a rank that
took a signal at once while a peer had begun step 1 leaves that peer blocked in the step's
collectives, torchrun ends it, and the job is a stop before training (75), which it is, since no
rank finished a step.

A scheduler's preemption or time limit (SLURM sends SIGTERM, and with ``--signal=USR1@T`` SIGUSR1 a
chosen time early) and Ctrl-C all become a request to stop at the end of the current step; the ranks
agree on it through the per-step reduction the trainer already does. A checkpoint is complete only
once its
``.metadata`` is written, so an exit in the middle of a save leaves the previous one the newest that
loads.

The signals are taken by ``exit_codes``' watcher thread, so that the grace timer and a second signal
act even while the main thread is blocked in a collective whose peer never joins.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

from torchtitan.tools.logging import logger

from canon_titan.components.exit_codes import (
    DUPLICATE_WINDOW_S,
    STOPPED,
    exit_now,
    report_training,
    take_stop_signals,
)


class Preempted(RuntimeError):
    pass


class StopSignals:
    def __init__(self, grace_seconds: int, on_disk: Callable[[], str] | None = None):
        """``on_disk`` says, when the process exits without saving, what is there to resume from."""
        self.grace_seconds = grace_seconds
        self.received_at: float | None = None
        self.on_disk = on_disk or (lambda: "nothing of this step was saved")
        self.installed = False
        self.trained = False

    def install(self) -> None:
        """Take the stop signals from now on (call from the main thread, as for any handler)."""
        take_stop_signals(self._handle)
        self.installed = True

    def step_done(self) -> None:
        """A step has trained (the first call tells the torchrun wrapper)."""
        if not self.trained:
            self.trained = True
            report_training()

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def _handle(self, signum: int) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self.received_at is None:
            self.received_at = now
            timer = threading.Timer(self.grace_seconds, self._out_of_time)
            timer.daemon = True
            timer.start()
            logger.warning(
                f"{name} received: finishing this step and saving a checkpoint (at most "
                f"{self.grace_seconds} s, [job] stop_grace_seconds; a second signal exits at once)"
            )
        elif now - self.received_at > DUPLICATE_WINDOW_S:
            logger.error(f"second {name}: exiting without saving this step; {self.on_disk()}")
            exit_now(STOPPED)  # not PREEMPTED: the step reached is not on disk

    def _out_of_time(self) -> None:
        logger.error(
            f"no checkpoint saved within [job] stop_grace_seconds = {self.grace_seconds}: exiting; "
            f"{self.on_disk()}"
        )
        exit_now(STOPPED)
