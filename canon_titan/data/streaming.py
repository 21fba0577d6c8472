"""Online (streaming) loading: documents are read and tokenized while training runs.

Each data-parallel rank runs ``num_workers`` loader workers (or reads in-process with 0); every
(rank, worker) pair is a *unit*. Each file of a source is cut into ``ceil(units / files)`` line
slices (line i of a file belongs to slice ``i mod slices``) and the slices are dealt to the units
round-robin, so every document is read by exactly one unit, for any number of ranks and workers.

A unit draws each next document from a source picked at random by the mixture weights (seeded),
wraps it in BOS/EOS, packs the tokens into ``seq_len + 1`` windows across document boundaries,
and passes the windows through a seeded shuffle buffer. Its state (file positions, leftover
tokens, shuffle buffer, random generators, the tokens drawn from each source) is checkpointed, so a
resumed run continues with the same windows; resuming needs the same number of ranks and workers.

The weights pick documents, so a source of longer documents supplies more of the tokens than its
weight: each window comes with its unit's count of the tokens drawn from each source so far, which
the loader keeps from each batch (``mixture``) for the log and TensorBoard.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from canon_titan.data.documents import (
    DATALOADER_KEY,
    DATALOADER_SKIP,
    DataError,
    ReadStats,
    expand_inputs,
    file_kind,
    iter_documents,
    missing_text,
)
from canon_titan.data.fingerprint import FINGERPRINT_KEY, data_fingerprint
from canon_titan.data.packed import batch_buffer, batch_views
from canon_titan.tools.host_memory import pinned


def unit_slices(files: list[str], unit: int, units: int) -> list[tuple[str, int, int]]:
    """The (file, slice, slices) pieces of a source that ``unit`` of ``units`` reads."""
    slices = max(1, math.ceil(units / len(files)))
    pieces = [(path, s, slices) for path in files for s in range(slices)]
    return pieces[unit::units]


class SourceReader:
    """Documents of one source for one unit, endlessly (epochs), with a resumable position."""

    def __init__(self, files, unit, units, text_key, on_error):
        self.source = files[0] if len(files) == 1 else f"{len(files)} files"
        self.pieces = unit_slices(files, unit, units)
        self.unit, self.text_key, self.on_error = unit, text_key, on_error
        self.epoch, self.piece, self.line = 0, 0, 0
        self.stats = ReadStats()
        self._iter = None

    def state(self) -> dict:
        return {"epoch": self.epoch, "piece": self.piece, "line": self.line}

    def load(self, state: dict) -> None:
        self.epoch, self.piece, self.line = state["epoch"], state["piece"], state["line"]
        self._iter = None

    def _documents(self):
        """Documents from (piece, line) on; ``line`` counts this slice's documents already read."""
        found_in_epoch = self.line > 0
        while self.pieces:
            path, index, slices = self.pieces[self.piece]
            documents = iter_documents(
                path, self.text_key, self.on_error, self.stats, DATALOADER_SKIP, DATALOADER_KEY
            )
            for n, text in enumerate(documents):
                if n % slices != index or n // slices < self.line:
                    continue
                self.line += 1
                found_in_epoch = True
                yield text
            self.piece, self.line = self.piece + 1, 0
            if self.piece == len(self.pieces):
                if not found_in_epoch:
                    return  # every slice of this unit is empty
                self.piece, self.epoch, found_in_epoch = 0, self.epoch + 1, False
                self._say_epoch_end()

    def _say_epoch_end(self) -> None:
        """Once per pass, by the first reader (rank 0's first): that its share of a source starts
        again (a source smaller than the run repeats)."""
        if self.unit == 0:
            logger.info(
                f"streamed data: epoch {self.epoch} of data reader 0 over {self.source} "
                "ended; it reads its "
                "share of them again"
            )

    def next(self) -> str | None:
        if self._iter is None:
            self._iter = self._documents()
        return next(self._iter, None)


class HubSourceReader(SourceReader):
    """A Hugging Face dataset streamed from the Hub (``hf:NAME[:CONFIG[:SPLIT]]``), split across
    units by ``datasets.distributed.split_dataset_by_node``; the position is the number of this
    unit's documents already read (skipped on resume)."""

    def __init__(self, spec, unit, units, text_key, on_error):
        parts = spec[len("hf:") :].split(":")
        self.name, self.subset = parts[0], parts[1] if len(parts) > 1 and parts[1] else None
        self.split = parts[2] if len(parts) > 2 else "train"
        self.unit, self.units, self.source = unit, units, spec
        self.pieces = [spec]
        self.text_key, self.on_error = text_key, on_error
        self.epoch, self.piece, self.line = 0, 0, 0
        self.stats = ReadStats()
        self._iter = None

    def _documents(self):
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node

        while True:
            try:
                dataset = load_dataset(self.name, self.subset, split=self.split, streaming=True)
            except Exception as e:
                raise DataError(
                    f"cannot stream Hugging Face dataset {self.name!r} "
                    f"(config {self.subset}, split {self.split}): {e}"
                ) from e
            dataset = split_dataset_by_node(dataset, rank=self.unit, world_size=self.units)
            # Resume by reading past this unit's consumed records: datasets' skip() after a node
            # split counts records of the whole stream, not of this node's share.
            records = itertools.islice(dataset, self.line, None)
            found = False
            for record in records:
                text = record.get(self.text_key) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    problem = (
                        missing_text(
                            f"{self.name}[{self.split}] document {self.line}",
                            record,
                            self.text_key,
                            DATALOADER_KEY,
                        )
                        if isinstance(record, dict)
                        else f"{self.name}[{self.split}] document {self.line}: not a record of "
                        "fields"
                    )
                    if self.on_error == "fail":
                        raise DataError(problem)
                    self.stats.skipped += 1
                    self.line += 1
                    continue
                self.line += 1
                found = True
                yield text
            if not found and self.line == 0:
                return
            self.epoch, self.line = self.epoch + 1, 0
            self._say_epoch_end()


def make_reader(source, files, unit, units, text_key, on_error):
    if source.startswith("hf:"):
        return HubSourceReader(source, unit, units, text_key, on_error)
    return SourceReader(files, unit, units, text_key, on_error)


class StreamingTextDataset(IterableDataset):
    def __init__(self, config, *, tokenizer, seq_len, dp_rank, dp_world_size):
        self.config, self.tokenizer, self.seq_len = config, tokenizer, seq_len
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.sources = [
            None if pattern.startswith("hf:") else expand_inputs(pattern)
            for pattern in config.sources
        ]
        for files in self.sources:
            for path in files or []:
                file_kind(path)
        self._state = None
        self._unit = None

    def _setup(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        unit, units = self.dp_rank * workers + worker, self.dp_world_size * workers
        cfg = self.config
        self.readers = [
            make_reader(source, files, unit, units, cfg.text_key, cfg.on_error)
            for source, files in zip(cfg.sources, self.sources)
        ]
        self.mixture_rng = random.Random(f"{cfg.seed}-mix-{unit}")
        self.shuffle_rng = random.Random(f"{cfg.seed}-shuffle-{unit}")
        self.buffer = np.zeros(0, dtype=np.int64)
        self.shuffle = []
        self.drawn = np.zeros(len(self.readers), dtype=np.int64)
        self._unit = unit
        if self._state is not None:
            self._restore(self._state)

    def _next_window(self) -> np.ndarray:
        need = self.seq_len + 1
        while len(self.buffer) < need:
            weights = self.config.weights or [1.0] * len(self.readers)
            source = self.mixture_rng.choices(range(len(self.readers)), weights=weights)[0]
            text = self.readers[source].next()
            if text is None:
                raise RuntimeError("a data source has no documents for this rank/worker")
            ids = self.tokenizer.encode(
                text, add_bos=self.config.add_bos, add_eos=self.config.add_eos
            )
            self.buffer = np.concatenate([self.buffer, np.asarray(ids, dtype=np.int64)])
            self.drawn[source] += len(ids)
        window, self.buffer = self.buffer[:need], self.buffer[need:]
        return window

    def __iter__(self):
        if self._unit is None:
            self._setup()
        size = self.config.shuffle_buffer
        while True:
            window = self._next_window()
            if size > 1:
                if len(self.shuffle) < size:
                    self.shuffle.append(window)
                    continue
                i = self.shuffle_rng.randrange(size)
                window, self.shuffle[i] = self.shuffle[i], window
            yield window, self.drawn.copy(), self._unit

    def state_dict(self) -> dict:
        if self._unit is None:
            return self._state or {}
        return {
            "readers": [r.state() for r in self.readers],
            "mixture_rng": self.mixture_rng.getstate(),
            "shuffle_rng": self.shuffle_rng.getstate(),
            "buffer": self.buffer.tolist(),
            "shuffle": [w.tolist() for w in self.shuffle],
            "drawn": self.drawn.tolist(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._state = state
        if self._unit is not None and state:
            self._restore(state)

    def _restore(self, state: dict) -> None:
        if not state:
            return
        for reader, s in zip(self.readers, state["readers"], strict=True):
            reader.load(s)
        self.mixture_rng.setstate(_as_rng_state(state["mixture_rng"]))
        self.shuffle_rng.setstate(_as_rng_state(state["shuffle_rng"]))
        self.buffer = np.asarray(state["buffer"], dtype=np.int64)
        self.shuffle = [np.asarray(w, dtype=np.int64) for w in state["shuffle"]]
        if "drawn" in state:  # not in a checkpoint from before the count
            self.drawn = np.asarray(state["drawn"], dtype=np.int64)


def _collated(items: list[tuple], *, bos_id: int | None, pin: bool) -> tuple:
    """A batch of windows in one host buffer (``batch_buffer``): pinned in the training process; a
    loader worker's, as it reaches the training process (the DataLoader's ``pin_memory``). With it,
    the tokens its unit had drawn per source by its last window, and the unit."""
    windows = [window for window, _, _ in items]
    _, drawn, unit = items[-1]
    return (
        batch_buffer(windows, bos_id, pin=pin and get_worker_info() is None),
        torch.from_numpy(drawn),
        unit,
    )


def _as_rng_state(state):
    version, internal, gauss = state
    return version, tuple(internal), gauss


class StreamingTextDataLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        sources: list[str] = field(default_factory=list)
        """One per source: a glob of document files (.jsonl, .json, .jsonl.zst/.zst, .parquet), or
        ``hf:NAME[:CONFIG[:SPLIT]]`` to stream a Hugging Face Hub dataset."""
        weights: list[float] = field(default_factory=list)
        """Mixture weights, one per source (default: equal)."""
        text_key: str = "text"
        on_error: Literal["fail", "skip"] = "fail"
        seed: int = 777
        shuffle_buffer: int = 64
        """Windows held for shuffling (1 = no shuffle)."""
        add_bos: bool = True
        add_eos: bool = True
        document_masking: bool = False
        pin_memory: bool = True
        """Pin each batch in host memory where CUDA is available."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size,
        dp_rank,
        tokenizer,
        seq_len,
        local_batch_size,
        **kwargs,
    ):
        dataset = StreamingTextDataset(
            config,
            tokenizer=tokenizer,
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
        )
        bos_id = tokenizer.bos_id if config.document_masking else None
        workers = config.num_workers
        collate = functools.partial(_collated, bos_id=bos_id, pin=config.pin_memory)
        pinned_by_loader = config.pin_memory and workers > 0 and torch.cuda.is_available()
        loader_kwargs = {
            "batch_size": local_batch_size,
            "num_workers": workers,
            "persistent_workers": config.persistent_workers,
            "collate_fn": collate,
            "pin_memory": pinned_by_loader,
            "prefetch_factor": config.prefetch_factor,
        }
        if kwargs.get("snapshot_every_n_steps") is not None:
            loader_kwargs["snapshot_every_n_steps"] = kwargs["snapshot_every_n_steps"]
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **loader_kwargs)
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.pin_batches = config.pin_memory
        self.fingerprint = data_fingerprint("stream", None, config.sources)
        self._fingerprint_saved = True
        self.sources = list(config.sources)
        self.weights = (
            [w / sum(config.weights) for w in config.weights]
            if config.weights
            else [1 / len(config.sources)] * len(config.sources)
        )
        self._drawn: dict[int, np.ndarray] = {}
        mixture = ", ".join(
            f"{source} {100 * w:.0f}%" for source, w in zip(self.sources, self.weights)
        )
        logger.info(
            f"Streaming {len(config.sources)} source(s) with {config.num_workers} worker(s) "
            f"on dp rank {dp_rank}/{dp_world_size}; the documents drawn by weight: "
            f"{mixture}"
        )

    def mixture(self) -> tuple[dict[str, float], str]:
        """The tokens this rank's readers drew from each source so far (its batches reach training
        within the shuffle buffer's windows): TensorBoard metrics and a log line."""
        drawn = sum(self._drawn.values(), np.zeros(len(self.sources), dtype=np.int64))
        total = int(drawn.sum()) or 1
        metrics = {f"data/source_{i}_token_share": int(n) / total for i, n in enumerate(drawn)}
        line = "; ".join(
            f"{source}: {100 * n / total:.1f}% (weight {100 * w:.0f}%)"
            for source, n, w in zip(self.sources, drawn.tolist(), self.weights)
        )
        return metrics, (
            f"streamed mixture, tokens drawn on dp rank {self.dp_rank} ({total:,}): {line}"
        )

    def __iter__(self):
        for buffer, drawn, unit in super().__iter__():
            self._drawn[unit] = drawn.numpy()  # the unit's count as of its latest window
            buffer = pinned(buffer) if self.pin_batches else buffer  # a worker's, on a CPU run
            yield batch_views(buffer, self.local_batch_size, self.seq_len)

    def expect_checkpoint(self, keys: list[str]) -> None:
        """Before a load: a checkpoint from before fingerprints holds none to fill in."""
        self._fingerprint_saved = FINGERPRINT_KEY in keys

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self._fingerprint_saved:
            state[FINGERPRINT_KEY] = self.fingerprint
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self._fingerprint_saved = True
        super().load_state_dict({k: v for k, v in state_dict.items() if k != FINGERPRINT_KEY})
