"""What a run does when its loss goes bad: ``[divergence]`` and the per-step decision.

The decision is made on the device, with no host sync: ``LossGuard.judge`` takes the step's loss
reduced across ranks and whether its gradients are all finite, and returns a flag that the fused
optimizer takes as its ``found_inf`` (as ``GradScaler`` gives it), so a bad step's update is never
applied, and a record of why. The host reads the record later (``LossGuard.verdict``: the next
step, or at once on a step that is logged or saved) to say what happened and to stop the run; a
decision to stop also holds back every later update, so what is saved or stopped on is the
weights before the bad step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


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
    """skip: do not apply that step's update and go on; stop: end the run as for a non-finite
    loss."""
    max_consecutive_skips: int = 10
    """Stop (as for a non-finite loss) when this many steps in a row were skipped: a loss that stays
    at a new level is a spike on every step, and a run that skips them all trains nothing."""


class Diverged(RuntimeError):
    pass


class NonFiniteLoss(Diverged):
    """A logged step's loss is not finite (TorchTitan's stop, kept by the queued step). The trainer
    reads that step's verdict first: a step the guard skipped goes on; one it did not stops the
    run."""


# What a step's record says (its ``kind``), and why a run stops (its ``stop``).
APPLIED, NONFINITE_LOSS, SPIKE, NONFINITE_GRADIENTS = range(4)
GO_ON, NONFINITE_LIMIT, SPIKE_STOP, SKIPS_IN_A_ROW = range(4)
RECORD_SIZE = 6
"""A record: the loss, the running mean it was held to, kind, steps skipped in a row, steps applied
since the run (re)started, stop."""


@dataclass
class StepVerdict:
    step: int
    skipped: bool
    stop: bool
    problem: str
    """Why the step was skipped or the run stops ("" for an applied step)."""
    in_a_row: int
    """Steps skipped in a row, this one included (0 for an applied step)."""
    applied: int
    """Steps applied since the run (re)started, this one included."""


class LossGuard:
    """The ``[divergence]`` state (the last ``spike_window`` kept losses, the non-finite count, the
    skips in a row, whether the run has been told to stop), kept on the device."""

    def __init__(self, section: DivergenceSection, device: torch.device):
        self.section = section
        self.recent = torch.zeros(section.spike_window, device=device)
        self.kept = torch.zeros((), dtype=torch.int64, device=device)
        self.nonfinite = torch.zeros((), device=device)
        self.in_a_row = torch.zeros((), device=device)
        self.stopped = torch.zeros((), dtype=torch.bool, device=device)

    def judge(
        self, loss: torch.Tensor, nonfinite_gradients: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the step's skip flag, 1.0 or 0.0; its record) from its loss and whether any gradient
        was not finite (both 0-dim, the same on every rank), by device ops alone."""
        section = self.section
        loss = loss.float()
        finite = loss.isfinite()
        window = section.spike_window
        mean = self.recent.sum() / window
        if section.spike_factor:
            spike = finite & (self.kept >= window) & (loss > section.spike_factor * mean)
        else:
            spike = torch.zeros_like(finite)
        # The gradients are judged only after a finite loss that is no spike.
        bad_gradients = finite & ~spike & (nonfinite_gradients > 0)
        nonfinite = ~finite | bad_gradients
        applied = ~(nonfinite | spike)
        self.nonfinite += nonfinite
        self.in_a_row = torch.where(applied, 0.0, self.in_a_row + 1)
        stop = torch.where(
            nonfinite & (self.nonfinite >= section.max_nonfinite_steps),
            NONFINITE_LIMIT,
            torch.where(
                spike & (section.on_spike == "stop"),
                SPIKE_STOP,
                torch.where(self.in_a_row >= section.max_consecutive_skips, SKIPS_IN_A_ROW, GO_ON),
            ),
        )
        self.stopped |= stop != GO_ON
        slot = (self.kept % window).view(1)
        self.recent.index_copy_(
            0, slot, torch.where(applied, loss, self.recent.index_select(0, slot))
        )
        self.kept += applied
        kind = torch.where(
            ~finite,
            NONFINITE_LOSS,
            torch.where(spike, SPIKE, torch.where(bad_gradients, NONFINITE_GRADIENTS, APPLIED)),
        )
        kept = self.kept.float()
        record = torch.stack([loss, mean, kind.float(), self.in_a_row, kept, stop.float()])
        return (~applied | self.stopped).float(), record

    def verdict(self, step: int, record: list[float]) -> StepVerdict:
        """What the host says of step ``step`` from its record (read back from the device)."""
        loss, mean, kind, in_a_row, applied, stop = record
        kind, in_a_row, applied, stop = int(kind), int(in_a_row), int(applied), int(stop)
        problem = ""
        if kind == NONFINITE_LOSS:
            problem = f"the loss at step {step} is not finite ({loss})"
        elif kind == SPIKE:
            problem = (
                f"the loss at step {step} ({loss:.4g}) is a spike, above "
                f"{self.section.spike_factor} x its "
                f"running mean {mean:.4g} ([divergence] spike_factor)"
            )
        elif kind == NONFINITE_GRADIENTS:
            problem = f"the gradients at step {step} are not finite (its loss was finite)"
        if stop == SKIPS_IN_A_ROW:
            problem += (
                f"; {in_a_row} steps in a row were skipped (steps "
                f"{step - in_a_row + 1}-{step}, [divergence] "
                "max_consecutive_skips), so the run trains nothing"
            )
        return StepVerdict(
            step=step,
            skipped=kind != APPLIED,
            stop=stop != GO_ON,
            problem=problem,
            in_a_row=in_a_row,
            applied=applied,
        )
