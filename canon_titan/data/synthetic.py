"""Synthetic playground tasks (``synthetic_data``) as a TorchTitan dataloader.

Global window ``w`` (``seq_len + 1`` tokens) is filled with whole samples drawn from its own
random stream ``(seed, w)`` until the next one does not fit; the rest is padding that the loss
ignores. Positions restart at every sample, so attention stays inside a sample (Canon layers,
like the reference's, still see the previous tokens of the window). As in the packed text
loader, a ``next()`` takes ``local_batch_size * dp_world_size`` consecutive global windows and
rank ``r`` the ``r``-th slice: the data do not depend on the data-parallel layout, ranks get
disjoint windows, and the checkpoint state is one global counter (exact resume).

Labels: with ``answer_only_loss`` only answer tokens are predicted (the reference's setting);
otherwise every token of a sample except its first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger

from canon_titan.data.packed import DataConfigError
from synthetic_data.common import Sample
from synthetic_data.tasks import PAD, make_task


MAX_REDRAWS = 100


def window_rng(seed: int, window: int) -> random.Random:
    return random.Random(f"{seed}/window/{window}")


class SyntheticDataLoader(BaseDataLoader):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "depo1"
        task: dict = field(default_factory=dict)
        """The task's parameters (keys of its params dataclass) over the dataset's preset."""
        seed: int = 777
        answer_only_loss: bool = False

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer=None,
                 seq_len: int, local_batch_size: int, **kwargs):
        self.config = config
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        try:
            self.task = make_task(config.dataset, **config.task)
        except (KeyError, ValueError, OSError) as e:
            raise DataConfigError(str(e)) from None
        if self.task.text and tokenizer is None:
            raise DataConfigError(f"{config.dataset} is text: it needs the run's tokenizer")
        if self.task.text and config.answer_only_loss:
            raise DataConfigError(f"{config.dataset} has no answer tokens: answer_only_loss must be false")
        self.tokenizer = tokenizer
        self.next_sample = 0
        probe = [self.window(w) for w in range(4)]
        fill = np.mean([(p[2] != IGNORE_INDEX).sum() / seq_len for p in probe])
        samples = np.mean([int(((p[1] == 0) & (p[0] != PAD)).sum()) for p in probe])
        logger.info(f"Synthetic dataset {config.dataset!r} ({self.task.params}): ~{samples:.1f} samples per "
                    f"window of {seq_len}, {100 * fill:.1f}% of positions in the loss "
                    f"(dp rank {dp_rank}/{dp_world_size})")

    def _sample(self, rng: random.Random) -> tuple[list[int], list[int]]:
        """Token ids and per-token loss flags of one sample."""
        sample = self.task.train_sample(rng)
        if isinstance(sample, Sample):
            labels = sample.labels if self.config.answer_only_loss else [0] + [1] * (len(sample.tokens) - 1)
            return sample.tokens, labels
        tokens = self.tokenizer.encode(sample, add_bos=True, add_eos=True)
        return tokens, [0] + [1] * (len(tokens) - 1)

    def window(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input ids, positions, targets) of global window ``index``."""
        rng, limit = window_rng(self.config.seed, index), self.seq_len + 1
        tokens, flags, positions = [], [], []
        redraws = 0
        while True:
            sample, sample_flags = self._sample(rng)
            if len(sample) > limit:
                # Lano sentences and tokenized biographies have no useful bound: a rare long one is
                # replaced by the next draw. For the other tasks the config check rules this out.
                redraws += 1
                if self.task.max_length() is not None or redraws > MAX_REDRAWS:
                    raise DataConfigError(
                        f"a {self.config.dataset} sample has {len(sample)} tokens (with the run's tokenizer), more "
                        f"than a window of seq_len + 1 = {limit}: raise [training] seq_len"
                        + (f" ({MAX_REDRAWS} samples in a row were too long)" if redraws > 1 else ""))
                continue
            if len(tokens) + len(sample) > limit:
                break
            tokens += sample
            flags += sample_flags
            positions += range(len(sample))
        pad = limit - len(tokens)
        tokens += [PAD] * pad
        flags += [0] * pad
        positions += range(pad)
        tokens_np = np.asarray(tokens, dtype=np.int64)
        targets = np.where(np.asarray(flags[1:], dtype=bool), tokens_np[1:], IGNORE_INDEX)
        return tokens_np[:-1], np.asarray(positions[:-1], dtype=np.int64), targets

    def batch(self, first_sample: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        start = first_sample + self.dp_rank * self.local_batch_size
        rows = [self.window(start + j) for j in range(self.local_batch_size)]
        inputs = {"input": torch.from_numpy(np.stack([r[0] for r in rows])),
                  "positions": torch.from_numpy(np.stack([r[1] for r in rows]))}
        return inputs, torch.from_numpy(np.stack([r[2] for r in rows]))

    def __iter__(self):
        while True:
            first = self.next_sample
            self.next_sample += self.local_batch_size * self.dp_world_size
            yield self.batch(first)

    def state_dict(self) -> dict:
        return {"next_sample": self.next_sample}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict:
            self.next_sample = int(state_dict["next_sample"])
            logger.info(f"Synthetic dataloader resumes at global window {self.next_sample:,}")
