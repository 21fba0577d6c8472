"""The learning-rate schedulers' resume without torch's warning about it."""

from __future__ import annotations

import warnings

GET_LR_WARNING = "To get the last learning rate computed by the scheduler"
"""The start of torch's warning when ``LRScheduler.get_lr()`` is called outside ``step()``."""


def quiet_resume(schedulers) -> None:
    """TorchTitan 0.3's ``LRSchedulersContainer.load_state_dict`` sets each scheduler's last
    learning rate with ``get_lr()`` outside ``step()``, which torch warns about
    (``lr_scheduler.py``: "please use `get_last_lr()`") on every resume, though the value is the
    one ``step()`` computes. That warning, in that call alone, is dropped
    (``tests/test_upstream.py`` holds TorchTitan to calling it)."""
    load = schedulers.load_state_dict

    def load_state_dict(state_dict) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=GET_LR_WARNING, category=UserWarning)
            load(state_dict)

    schedulers.load_state_dict = load_state_dict
