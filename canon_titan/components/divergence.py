"""What a run does when its loss goes bad: ``[divergence]`` and the per-step decision.

The trainer reduces every step's loss across ranks before the optimizer step (whatever
``[metrics] log_freq`` is), so a bad step can be skipped (its update never applied) or stop the
run before any checkpoint of it is written."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class DivergenceSection:
    max_nonfinite_steps: int = 1
    """Stop at this many non-finite (NaN/inf) losses, counted since the run (re)started, not only
    consecutive ones; the ones before it are skipped (their update is not applied). 1 = stop at the
    first."""
    spike_factor: float = 0.0
    """A loss above this multiple of the running mean of the last `spike_window` losses is a spike
    (0 = no spike check)."""
    spike_window: int = 20
    on_spike: Literal["skip", "stop"] = "skip"
    """skip: do not apply that step's update and go on; stop: end the run as for a non-finite loss."""
    max_consecutive_skips: int = 10
    """Stop (as for a non-finite loss) when this many steps in a row were skipped: a loss that stays
    at a new level is a spike on every step, and a run that skips them all trains nothing."""


class Diverged(RuntimeError):
    pass


class LossGuard:
    """Decides, from a step's loss and then its gradient norm, whether to apply its update ("ok"),
    skip it ("skip") or stop; the caller raises Diverged with ``problem`` on "stop"."""

    def __init__(self, section: DivergenceSection):
        self.section = section
        self.recent: deque[float] = deque(maxlen=section.spike_window)
        self.nonfinite = 0
        self.skipped_in_a_row = self._skipped_before = 0
        self.problem = ""

    def judge(self, step: int, loss: float) -> str:
        if not math.isfinite(loss):
            return self._nonfinite(step, f"the loss at step {step} is not finite ({loss})")
        factor = self.section.spike_factor
        if factor and len(self.recent) == self.recent.maxlen:
            mean = sum(self.recent) / len(self.recent)
            if loss > factor * mean:
                self.problem = (f"the loss at step {step} ({loss:.4g}) is a spike, above {factor} x its running "
                                f"mean {mean:.4g} ([divergence] spike_factor)")
                return "stop" if self.section.on_spike == "stop" else self._skip(step)
        self.recent.append(loss)
        self._skipped_before, self.skipped_in_a_row = self.skipped_in_a_row, 0
        return "ok"

    def judge_gradients(self, step: int, finite: bool) -> str:
        """After a finite loss: a step whose gradients are not all finite is not applied either."""
        if finite:
            return "ok"
        self.recent.pop()  # its loss was counted as accepted
        self.skipped_in_a_row = self._skipped_before
        return self._nonfinite(step, f"the gradients at step {step} are not finite (its loss was finite)")

    def _nonfinite(self, step: int, problem: str) -> str:
        self.nonfinite += 1
        self.problem = problem
        if self.nonfinite >= self.section.max_nonfinite_steps:
            return "stop"
        return self._skip(step)

    def _skip(self, step: int) -> str:
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row >= self.section.max_consecutive_skips:
            self.problem += (f"; {self.skipped_in_a_row} steps in a row were skipped (steps "
                             f"{step - self.skipped_in_a_row + 1}-{step}, [divergence] max_consecutive_skips), "
                             "so the run trains nothing")
            return "stop"
        return "skip"
