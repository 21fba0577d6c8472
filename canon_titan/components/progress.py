"""The run's progress line: the step, its share of the run, the time so far and an ETA."""

from __future__ import annotations

import datetime
import time


def duration(seconds: float) -> str:
    if seconds > 100 * 365 * 86400:
        return f"{seconds / (365 * 86400):.3g} years"
    return str(datetime.timedelta(seconds=round(seconds)))


class Progress:
    """The first step of a run, or of a resumed one, compiles the model and tunes its kernels
    (seconds to minutes), so the ETA extrapolates from the steps after it; the time so far counts
    it."""

    def __init__(self, total: int, clock=time.perf_counter):
        self.total, self.clock = total, clock
        self.started: float | None = None
        self.after_first: tuple[float, int] | None = None
        """When the first step ended, and its number."""

    def step_starts(self) -> None:
        if self.started is None:
            self.started = self.clock()

    def step_done(self, step: int) -> None:
        if self.after_first is None:
            self.after_first = (self.clock(), step)

    def line(self, step: int) -> str:
        now = self.clock()
        first_ended, first = self.after_first
        if step >= self.total:
            eta = "0:00:00"
        elif step > first:
            eta = duration((now - first_ended) / (step - first) * (self.total - step))
        else:
            eta = f"? (estimated from step {first + 1} on, past the first step's compile, tuning)"
        return (
            f"progress: step {step}/{self.total} ({100 * step / self.total:.0f}%), "
            f"elapsed {duration(now - self.started)}, ETA {eta}"
        )
