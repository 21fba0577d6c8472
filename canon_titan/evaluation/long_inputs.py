"""Inputs longer than an evaluation's ``max_length``, counted per task.

lm-eval keeps the last ``max_length`` tokens of a longer input (for a generation, ``max_length``
less the tokens it may generate) and says so at most once per batch, without the task's name.
``CountingHFLM`` is its ``HFLM`` recording, per task, how many inputs it cut that way, the longest
one's length and the limit, so the evaluation can say it once per task and write it down.
"""

from __future__ import annotations

from dataclasses import dataclass

from lm_eval.models.huggingface import HFLM


@dataclass
class Cut:
    inputs: int
    """The task's inputs longer than the limit."""
    longest: int
    """Tokens of the longest."""
    limit: int
    """Tokens the model read of each (the last ones)."""


class CountingHFLM(HFLM):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inputs: dict[str, int] = {}
        """Inputs per task."""
        self.cut: dict[str, Cut] = {}
        self._tasks: dict = {}
        """A request's text (the key lm-eval tokenizes it under) -> the tasks that asked for it."""

    def _index(self, requests, key) -> None:
        self._tasks = {}
        for request in requests:
            self._tasks.setdefault(key(request), set()).add(request.task_name)
            self.inputs[request.task_name] = self.inputs.get(request.task_name, 0) + 1

    def _note(self, key, length: int, limit: int) -> None:
        if length <= limit:
            return
        for task in self._tasks.get(key, ()):
            cut = self.cut.setdefault(task, Cut(0, 0, limit))
            cut.inputs += 1
            cut.longest = max(cut.longest, length)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._index(requests, key=lambda r: r.args)
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        for key, context, continuation in requests:
            if key is not None:  # None: a perplexity task's window, max_length long by construction
                # the model reads every token but the continuation's last
                self._note(key, len(context) + len(continuation) - 1, self.max_length)
        return super()._loglikelihood_tokens(
            requests, disable_tqdm=disable_tqdm, override_bs=override_bs
        )

    def generate_until(self, requests, disable_tqdm: bool = False):
        self._index(requests, key=lambda r: r.args[0])
        return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def tok_batch_encode(
        self, strings, padding_side="left", left_truncate_len=None, truncation=False
    ):
        ids, mask = super().tok_batch_encode(
            strings, padding_side=padding_side, truncation=truncation
        )
        if left_truncate_len:
            for text, length in zip(strings, mask.sum(1).tolist()):
                self._note(text, length, left_truncate_len)
            ids, mask = ids[:, -left_truncate_len:], mask[:, -left_truncate_len:]
        return ids, mask
