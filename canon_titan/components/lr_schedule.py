"""TorchTitan's learning-rate schedulers, resumed without torch's warning about it.

Kept light (no model or data imports): ``config validate`` builds this section's config."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torchtitan.components.optimizer import LRSchedulersContainer

GET_LR_WARNING = "To get the last learning rate computed by the scheduler"
"""The start of torch's warning when ``LRScheduler.get_lr()`` is called outside ``step()``."""


class ResumableSchedulers(LRSchedulersContainer):
    """TorchTitan 0.3's ``load_state_dict`` sets each scheduler's last learning rate with
    ``get_lr()`` outside ``step()``, which torch warns about (``lr_scheduler.py``: "please use
    `get_last_lr()`") on every resume, though the value is the one ``step()`` computes. That
    warning, in that call alone, is dropped (``tests/test_upstream.py`` holds TorchTitan to
    calling it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        def build(self, *, optimizers, training_steps) -> ResumableSchedulers:
            # TorchTitan's build makes its own class: its schedule, in this one
            built = LRSchedulersContainer.Config.build(
                self, optimizers=optimizers, training_steps=training_steps
            )
            return ResumableSchedulers(optimizers, built.schedulers[0].lr_lambdas[0])

    def load_state_dict(self, state_dict) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=GET_LR_WARNING, category=UserWarning)
            super().load_state_dict(state_dict)
