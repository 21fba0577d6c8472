"""Synthetic playground tasks (``synthetic_data``) as a TorchTitan dataloader.

Packing. Every sample comes from its own random stream ``(seed, window w, draw k)``. Global
window ``w`` (``seq_len + 1`` tokens) first takes the sample carried into it (below), then draws
``k = 0, 1, ...`` and packs whole samples while they fit. The first sample that does not fit is not
dropped: it is carried to window ``w + stride`` (``stride`` = windows per optimizer step, the global
batch), where it goes first. So every drawn sample is trained on exactly once and the packed
samples follow the generator's distribution; dropping the misfits, as a plain greedy packer does,
would drop long samples more often than short ones (a bias toward easy items). The rest of a window
is padding that the loss ignores. Positions restart at every sample, so attention stays inside a
sample (Canon layers, like the reference's, still see the previous tokens of the window).

Layout. As in the packed text loader, a ``next()`` takes ``local_batch_size * dp_world_size``
consecutive global windows and rank ``r`` the ``r``-th slice: the data do not depend on the
data-parallel layout (for a given global batch), ranks get disjoint windows, and a window's carry
goes to the window the same rank reads one step later. The checkpoint state is the next window
and each rank's pending carries, under a key per rank. A resume reads the carries of every rank
of the checkpoint (``expect_checkpoint``) and keeps those of the windows it will read, so a run
resumed at another data-parallel size (same global batch) gets exactly the windows of a run that
had that size from the start. Without carries in the state (a fresh loader asked for a window
mid-stream) they are recomputed from the windows before.

Labels: with ``answer_only_loss`` only answer tokens are predicted (the reference's setting);
otherwise every token of a sample except its first.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger

from canon_titan.data.inputs import DataConfigError
from canon_titan.data.packed import with_boundaries
from canon_titan.tools.host_memory import host_buffer
from synthetic_data.common import Sample
from synthetic_data.tasks import PAD, SECTION, make_task

MAX_REDRAWS = 100

SampleId = tuple[int, int]
"""(window whose stream drew it, draw index): the sample's own random stream."""
CARRIES = "carries_dp_rank_"
"""State key prefix of a rank's pending carries (``carries_dp_rank_0``, ...)."""


def sample_stream(seed: int, window: int, draw: int) -> random.Random:
    return random.Random(f"{seed}/window/{window}/{draw}")


class _Batches(IterableDataset):
    """A synthetic loader's local batches from its position on, each in one host buffer; packed in
    the training process (each window starts with the sample carried from the window this rank
    read one step before, which another worker process would not have)."""

    def __init__(self, loader: SyntheticDataLoader):
        self.loader = loader

    def __iter__(self):
        first = self.loader.next_sample
        while True:
            yield self.loader.buffer(first)
            first += self.loader.local_batch_size * self.loader.dp_world_size


class SyntheticDataLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "depo1"
        task: dict = field(default_factory=dict)
        """The task's parameters (keys of its params dataclass) over the dataset's preset."""
        seed: int = 777
        answer_only_loss: bool = False
        windows_per_step: int = 0
        """The global batch in windows (a carried sample moves this many windows on); 0 means
        local_batch_size x dp_world_size."""
        pin_memory: bool = True
        """Build each batch in pinned host memory where CUDA is available."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer=None,
        seq_len: int,
        local_batch_size: int,
        **kwargs,
    ):
        super().__init__(
            _Batches(self), dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=None
        )
        self.config = config
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.stride = config.windows_per_step or local_batch_size * dp_world_size
        try:
            self.task = make_task(config.dataset, **config.task)
        except (KeyError, ValueError, OSError) as e:
            raise DataConfigError(str(e)) from None
        if self.task.text and tokenizer is None:
            raise DataConfigError(f"{config.dataset} is text: it needs the run's tokenizer")
        if self.task.text and config.answer_only_loss:
            raise DataConfigError(
                f"{config.dataset} has no answer tokens: answer_only_loss must be false"
            )
        self.tokenizer = tokenizer
        self.next_sample = 0
        self._carries: dict[int, SampleId] = {}
        """Destination window -> the sample carried into it, for windows this rank reads next."""
        self._replay = True
        """Recompute a carry missing from ``_carries`` (False once a checkpoint's carries are
        loaded: they are complete, and a window missing there starts fresh)."""
        self._checkpoint_keys: list[str] | None = None
        probe = [self.window(w) for w in range(4)]
        fill = np.mean([(p[2] != IGNORE_INDEX).sum() / seq_len for p in probe])
        samples = np.mean([int(((p[1] == 0) & (p[0] != PAD)).sum()) for p in probe])
        logger.info(
            f"Synthetic dataset {config.dataset!r} ({self.task.params}): ~{samples:.1f} "
            "samples per "
            f"window of {seq_len}, {100 * fill:.1f}% of positions in the loss "
            f"(dp rank {dp_rank}/{dp_world_size})"
        )

    def stream(self, sample: SampleId) -> random.Random:
        return sample_stream(self.config.seed, *sample)

    def draw(self, sample: SampleId) -> tuple[list[int], list[int]]:
        """Token ids and per-token loss flags of one sample."""
        generated = self.task.train_sample(self.stream(sample))
        if isinstance(generated, Sample):
            labels = (
                generated.labels
                if self.config.answer_only_loss
                else [0] + [1] * (len(generated.tokens) - 1)
            )
            return generated.tokens, labels
        tokens = self.tokenizer.encode(generated, add_bos=True, add_eos=True)
        return tokens, [0] + [1] * (len(tokens) - 1)

    def pack(
        self, index: int, carried: SampleId | None
    ) -> tuple[list[tuple[SampleId, list[int], list[int]]], SampleId]:
        """Window ``index``'s samples in order, ``carried`` first, as (id, tokens, loss flags); and
        the misfit it carries on."""
        limit, used, draws, redraws = self.seq_len + 1, 0, 0, 0
        packed = [(carried, *self.draw(carried))] if carried is not None else []
        used = sum(len(tokens) for _, tokens, _ in packed)
        while True:
            sample = (index, draws)
            draws += 1
            tokens, flags = self.draw(sample)
            if len(tokens) > limit:
                # Lano sentences and tokenized biographies have no useful bound: a rare long one is
                # replaced by the next draw. For the other tasks the config check rules this out.
                redraws += 1
                if self.task.max_length() is not None or redraws > MAX_REDRAWS:
                    raise DataConfigError(
                        f"a {self.config.dataset} sample has {len(tokens)} tokens (with "
                        "the run's tokenizer), "
                        f"more than a window of seq_len + 1 = {limit}: raise [training] seq_len"
                        + (
                            f" ({MAX_REDRAWS} samples in a row were too long)"
                            if redraws > 1
                            else ""
                        )
                    )
                continue
            if used + len(tokens) > limit:
                return packed, sample
            packed.append((sample, tokens, flags))
            used += len(tokens)

    def carried_into(self, index: int) -> SampleId | None:
        """The sample window ``index`` starts with: the misfit of window ``index - stride``."""
        if index < self.stride:
            return None
        if index in self._carries:
            return self._carries.pop(index)
        if not self._replay:
            return None
        carried = None  # not known here (another layout before): replay the windows before it
        for earlier in range(index % self.stride, index, self.stride):
            carried = self.pack(earlier, carried)[1]
        return carried

    def samples(self) -> Iterator[tuple[int, SampleId, list[int], list[int]]]:
        """Every sample in training order, as (window, id, tokens, loss flags)."""
        carries: dict[int, SampleId] = {}
        for index in itertools.count():
            packed, carries[index + self.stride] = self.pack(index, carries.pop(index, None))
            for sample, tokens, flags in packed:
                yield index, sample, tokens, flags

    def arrays(
        self, packed: list[tuple[SampleId, list[int], list[int]]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input ids, positions, targets) of a window holding ``packed``."""
        tokens, flags, positions = [], [], []
        for _, sample_tokens, sample_flags in packed:
            tokens += sample_tokens
            flags += sample_flags
            positions += range(len(sample_tokens))
        pad = self.seq_len + 1 - len(tokens)
        tokens += [PAD] * pad
        flags += [0] * pad
        positions += range(pad)
        tokens_np = np.asarray(tokens, dtype=np.int64)
        targets = np.where(np.asarray(flags[1:], dtype=bool), tokens_np[1:], IGNORE_INDEX)
        return tokens_np[:-1], np.asarray(positions[:-1], dtype=np.int64), targets

    def window(
        self, index: int, carried: SampleId | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input ids, positions, targets) of global window ``index`` starting with ``carried``."""
        return self.arrays(self.pack(index, carried)[0])

    def buffer(self, first_sample: int) -> torch.Tensor:
        """This rank's rows of the ``local_batch_size * dp_world_size`` windows from
        ``first_sample`` in one flat host buffer (inputs, positions, targets); each row's misfit is
        kept for the window ``stride`` later."""
        start = first_sample + self.dp_rank * self.local_batch_size
        batch = self.local_batch_size
        flat = host_buffer(3 * batch * self.seq_len, torch.int64, pin=self.config.pin_memory)
        rows = flat.view(3, batch, self.seq_len).numpy()
        for row, index in enumerate(range(start, start + batch)):
            packed, self._carries[index + self.stride] = self.pack(index, self.carried_into(index))
            rows[:, row] = self.arrays(packed)
        return flat

    def views(self, flat: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The inputs, positions and targets in ``buffer``'s buffer: views of it, copied as one."""
        tokens, positions, targets = flat.view(3, self.local_batch_size, self.seq_len).unbind()
        return with_boundaries({"input": tokens, "positions": positions}), targets

    def batch(self, first_sample: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """This rank's batch of the global batch from ``first_sample`` (``buffer``'s, viewed)."""
        return self.views(self.buffer(first_sample))

    def __iter__(self):
        for flat in super().__iter__():
            self.next_sample += self.local_batch_size * self.dp_world_size
            yield self.views(flat)

    def reads(self, index: int) -> bool:
        """Whether this rank reads global window ``index``."""
        return (
            index % (self.local_batch_size * self.dp_world_size) // self.local_batch_size
            == self.dp_rank
        )

    def expect_checkpoint(self, keys: list[str]) -> None:
        """Before a checkpoint load: the loader entries the checkpoint holds (names below
        ``dataloader.``). The next ``state_dict()``, the template DCP fills, asks for exactly those,
        the carries of every rank that wrote it included, whatever this run's layout."""
        self._checkpoint_keys = list(keys)

    def state_dict(self) -> dict:
        if self._checkpoint_keys is not None:
            return {key: None for key in self._checkpoint_keys}
        # next_sample is the same on every rank (one copy in the checkpoint); the carries differ.
        return {
            "next_sample": self.next_sample,
            "windows_per_step": self.stride,
            f"{CARRIES}{self.dp_rank}": sorted(self._carries.items()),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._checkpoint_keys = None
        if not state_dict:
            return
        self.next_sample = int(state_dict["next_sample"])
        saved = [key for key in state_dict if key.startswith(CARRIES)]
        if not saved:  # a checkpoint from before the carries: recompute them
            logger.info(f"Synthetic dataloader resumes at global window {self.next_sample:,}")
            return
        carries = {
            int(dest): tuple(sample) for key in saved for dest, sample in state_dict[key] or []
        }
        self._carries = {dest: sample for dest, sample in carries.items() if self.reads(dest)}
        self._replay = False
        stride = int(state_dict.get("windows_per_step", self.stride))
        layout = (
            f"{len(saved)} data-parallel rank(s) to {self.dp_world_size}"
            if len(saved) != self.dp_world_size
            else ""
        )
        if stride != self.stride:
            logger.warning(
                f"Synthetic dataloader: the global batch changed from {stride} to "
                f"{self.stride} windows; "
                "every drawn sample is still trained on once, but from here the windows "
                "differ from "
                "those of a run that had this global batch from the start"
            )
        logger.info(
            f"Synthetic dataloader resumes at global window {self.next_sample:,}"
            + (f" (resharded from {layout})" if layout else "")
        )


def loader_config(run) -> SyntheticDataLoader.Config:
    """The loader of a resolved run whose dataset is a synthetic task."""
    section = run["dataloader"]
    task = {k: v for k, v in run[SECTION[section["dataset"]]].items() if v is not None}
    return SyntheticDataLoader.Config(
        dataset=section["dataset"],
        task=task,
        seed=section["seed"],
        answer_only_loss=section["answer_only_loss"],
        windows_per_step=max(run["training"]["global_batch_size"], 0),
        pin_memory=section["pin_memory"],
    )
