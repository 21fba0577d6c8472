"""Packed-token dataloader whose global batches do not depend on the data-parallel layout.

Documents are tokenized with BOS/EOS and concatenated into one token stream, cut into windows of
``seq_len + 1`` tokens (input = first ``seq_len``, labels = shifted by one), packed across
document boundaries with plain causal attention, as in the reference. Window order is a seeded
permutation per epoch. Global sample ``i`` is the same window for any number of ranks: each
``next()`` consumes ``local_batch_size * dp_world_size`` global samples and rank ``r`` takes the
``r``-th slice, so 1 rank with batch 4 and 2 ranks with batch 2 see the same global batch. The
checkpointed state is the global sample counter, so a run can also resume on another layout.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    iter_documents,
)
from canon_titan.data.fingerprint import FINGERPRINT_KEY, data_fingerprint
from canon_titan.data.held_out import held_out_shards, shard_part
from canon_titan.data.inputs import DataConfigError, resolve_paths
from canon_titan.data.pretokenize import open_shards
from canon_titan.data.token_store import TokenStore
from canon_titan.kernels.documents import document_boundaries
from canon_titan.tools.host_memory import host_buffer, is_pinned, pinned


def document_positions(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Position of each token within its document; a window starts at position 0 and every BOS
    starts a new document."""
    index = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    starts = torch.where(tokens == bos_id, index, torch.zeros_like(index))
    starts[..., 0] = 0
    return index - torch.cummax(starts, dim=-1).values


def tokenize_stream(texts, tokenizer, add_bos: bool, add_eos: bool) -> np.ndarray:
    dtype = np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.uint32
    chunks = [
        np.asarray(tokenizer.encode(t, add_bos=add_bos, add_eos=add_eos), dtype=dtype)
        for t in texts
    ]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def load_token_store(config, tokenizer) -> TokenStore:
    if config.dataset == "tokens":
        store = open_shards(config.dataset_path, tokenizer)
        if not config.held_out_fraction:
            return store
        return shard_part(
            store,
            held_out_shards(config.dataset_path, config.held_out_fraction),
            config.read_held_out,
        )
    stats = ReadStats()
    texts = (
        text
        for path in resolve_paths(config.dataset, config.dataset_path)
        for text in iter_documents(
            path, config.text_key, config.on_error, stats, DATALOADER_SKIP, DATALOADER_KEY
        )
    )
    store = TokenStore([tokenize_stream(texts, tokenizer, config.add_bos, config.add_eos)])
    if stats.skipped and not stats.documents:
        raise DataError(
            f'every record was skipped ({stats.skipped}, [dataloader] on_error = "skip"), '
            "so there is "
            f"no text to train on; the first: {stats.problems[0]}"
        )
    if stats.skipped:
        logger.warning(f"skipped {stats.skipped} bad records ({stats.documents} documents read)")
    return store


def batch_buffer(rows: list[np.ndarray], bos_id: int | None, *, pin: bool) -> torch.Tensor:
    """A local batch of ``rows`` (``seq_len + 1`` tokens each) in one flat int64 host buffer, pinned
    when ``pin`` (``tools/host_memory``): the rows, then (``bos_id`` given) each input's document
    positions. ``batch_views`` takes the batch's tensors from it."""
    batch, width = len(rows), len(rows[0])
    tokens = batch * width
    positions = batch * (width - 1) if bos_id is not None else 0
    flat = host_buffer(tokens + positions, torch.int64, pin=pin)
    data = flat[:tokens].view(batch, width)
    np.stack(rows, out=data.numpy())
    if bos_id is not None:
        flat[tokens:].view(batch, width - 1).copy_(document_positions(data[:, :-1], bos_id))
    return flat


def batch_views(
    flat: torch.Tensor, batch: int, seq_len: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The inputs (and positions, when the buffer holds them) and labels in ``batch_buffer``'s
    buffer: views of it, so the step copies the buffer once (``tools/host_memory.to_device``).
    With positions, the documents' boundaries too (``with_boundaries``)."""
    tokens = batch * (seq_len + 1)
    data = flat[:tokens].view(batch, seq_len + 1)
    inputs = {"input": data[:, :-1]}
    if flat.numel() > tokens:
        inputs["positions"] = flat[tokens:].view(batch, seq_len)
        with_boundaries(inputs)
    return inputs, data[:, 1:]


def with_boundaries(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``inputs`` with the boundaries of the documents in its ``positions`` in fla's layout
    (``kernels/documents.document_boundaries``): their sizes vary by batch, so they share a small
    host buffer of their own beside the batch's (pinned as the batch's is), one more copy a step."""
    boundaries = document_boundaries(inputs["positions"])
    size = sum(t.numel() for t in boundaries.values())
    flat = host_buffer(size, torch.int32, pin=is_pinned(inputs["positions"]))
    start = 0
    for name, tensor in boundaries.items():
        inputs[name] = flat[start : start + tensor.numel()].view(tensor.shape).copy_(tensor)
        start += tensor.numel()
    return inputs


class PackedWindows(IterableDataset):
    """The local batches of a packed loader from global sample ``start`` on, each in one flat host
    buffer (``batch_buffer``); in loader worker ``w`` of ``W``, the batches ``w``, ``w + W``, ...,
    which the DataLoader hands over in order."""

    def __init__(
        self,
        config,
        tokens: TokenStore,
        *,
        dp_rank: int,
        dp_world_size: int,
        seq_len: int,
        local_batch_size: int,
        bos_id: int | None,
    ):
        self.config, self.tokens = config, tokens
        self.dp_rank, self.seq_len, self.local_batch_size = dp_rank, seq_len, local_batch_size
        self.global_batch = local_batch_size * dp_world_size
        self.num_windows = (len(tokens) - 1) // seq_len
        self.bos_id = bos_id
        self.start = 0
        self._perm_epoch, self._perm = -1, None

    def _window_start(self, sample: int) -> int:
        epoch, offset = divmod(sample, self.num_windows)
        if not self.config.shuffle:
            return offset * self.seq_len
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.config.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.num_windows), epoch
        return int(self._perm[offset]) * self.seq_len

    def buffer(self, first_sample: int, *, pin: bool) -> torch.Tensor:
        """The local batch whose global batch starts at ``first_sample``, in one buffer."""
        start = first_sample + self.dp_rank * self.local_batch_size
        rows = [
            self.tokens.slice(s, s + self.seq_len + 1)
            for s in (self._window_start(start + j) for j in range(self.local_batch_size))
        ]
        return batch_buffer(rows, self.bos_id, pin=pin)

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        first = self.start + worker * self.global_batch
        # A worker's batch is pinned as it reaches the training process (DataLoader's pin_memory).
        pin = self.config.pin_memory and info is None
        while self.config.infinite or first + self.global_batch <= self.num_windows:
            yield self.buffer(first, pin=pin)
            first += workers * self.global_batch


class PackedTextDataLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "builtin"
        """'builtin' (the project's story corpus), 'files' (JSON lines / .zst / Parquet documents,
        tokenized at start-up) or 'tokens' (a folder written by ``canon-titan data tokenize``)."""
        dataset_path: str | None = None
        """Glob of document files (dataset = 'files') or the token folder (dataset = 'tokens')."""
        text_key: str = "text"
        on_error: Literal["fail", "skip"] = "fail"
        """What a bad record does (a line that is not JSON, no text field, a truncated .zst)."""
        seed: int = 777
        """Seed of the per-epoch window permutation."""
        shuffle: bool = True
        add_bos: bool = True
        add_eos: bool = True
        infinite: bool = True
        """Start a new (re-shuffled) epoch when the windows run out, instead of stopping."""
        document_masking: bool = False
        """Emit positions that restart at every BOS, and the documents' boundaries in fla's layout
        (``kernels/documents.py``): each packed document is computed as if alone (docs/data.md)."""
        held_out_fraction: float = 0.0
        """tokens: this fraction of the folder's shards is held out for validation
        (``data.held_out.held_out_shards``)."""
        read_held_out: bool = False
        """Read the held-out shards (the validation loader) instead of the others."""
        pin_memory: bool = True
        """Build each batch in pinned host memory where CUDA is available."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer,
        seq_len: int,
        local_batch_size: int,
        **kwargs,
    ):
        self.config = config
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        try:
            tokens = load_token_store(config, tokenizer)
        except DataError as e:
            raise DataConfigError(str(e)) from None
        num_windows = (len(tokens) - 1) // seq_len
        if num_windows < local_batch_size * dp_world_size:
            raise DataConfigError(
                f"dataset {config.dataset!r} has {len(tokens)} tokens: fewer than one global "
                f"batch of {local_batch_size * dp_world_size} x {seq_len + 1} tokens"
            )
        bos_id = tokenizer.bos_id if config.document_masking else None
        if config.document_masking and bos_id is None:
            raise DataConfigError("dataloader.document_masking needs a tokenizer with a BOS token")
        windows = PackedWindows(
            config,
            tokens,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            seq_len=seq_len,
            local_batch_size=local_batch_size,
            bos_id=bos_id,
        )
        workers = config.num_workers
        pinned_by_loader = config.pin_memory and workers > 0 and torch.cuda.is_available()
        super().__init__(
            windows,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=None,
            num_workers=workers,
            prefetch_factor=config.prefetch_factor,
            pin_memory=pinned_by_loader,
        )
        self.tokens, self.num_windows = tokens, num_windows
        self.next_sample = 0
        """The first global sample of the next batch the step gets (the checkpointed position)."""
        self.fingerprint = data_fingerprint(
            config.dataset, config.dataset_path, [], held_out_fraction=config.held_out_fraction
        )
        self._fingerprint_saved = True
        logger.info(
            f"Packed dataset {config.dataset!r}: {len(tokens):,} tokens, "
            f"{num_windows:,} windows of {seq_len} (dp rank {dp_rank}/{dp_world_size})"
        )

    def batch(self, first_sample: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The local batch whose global batch starts at ``first_sample``."""
        buffer = self.dataset.buffer(first_sample, pin=self.config.pin_memory)
        return batch_views(buffer, self.local_batch_size, self.seq_len)

    def __iter__(self):
        # The batches from the position reached: workers (if any) start there as the iterator does.
        self.dataset.start = self.next_sample
        for buffer in super().__iter__():
            first = self.next_sample
            self.next_sample += self.dataset.global_batch
            self._say_epoch_end(first, self.next_sample)
            if self.config.pin_memory:
                buffer = pinned(buffer)  # a worker's, on a CPU run (the DataLoader pins it on CUDA)
            yield batch_views(buffer, self.local_batch_size, self.seq_len)

    def _say_epoch_end(self, first: int, after: int) -> None:
        """On rank 0, once per epoch: that the batch of global samples [first, after) starts another
        pass over the data, with the tokens trained on so far (a corpus smaller than the run
        repeats)."""
        ended = (after - 1) // self.num_windows  # the epochs done before the batch's last sample
        if ended == max(first - 1, 0) // self.num_windows or (
            torch.distributed.is_initialized() and torch.distributed.get_rank() != 0
        ):
            return
        seen = ended * self.num_windows * self.seq_len
        reshuffled = "reshuffled" if self.config.shuffle else "in the same order"
        logger.info(
            f"dataset {self.config.dataset!r}: epoch {ended} ended ({self.num_windows:,} "
            "windows of "
            f"{self.seq_len} tokens each, {seen:,} tokens seen in all); epoch {ended + 1} "
            "reads the same "
            f"data again, {reshuffled}"
        )

    def expect_checkpoint(self, keys: list[str]) -> None:
        """Before a load: a checkpoint from before fingerprints holds none to fill in."""
        self._fingerprint_saved = FINGERPRINT_KEY in keys

    def state_dict(self) -> dict:
        # Identical on every rank (a global position), so DCP keeps one copy.
        state = {"next_sample": self.next_sample}
        if self._fingerprint_saved:
            state[FINGERPRINT_KEY] = self.fingerprint
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self._fingerprint_saved = True
        if not state_dict:
            return
        self.next_sample = int(state_dict["next_sample"])
        logger.info(f"Dataloader resumes at global sample {self.next_sample:,}")
