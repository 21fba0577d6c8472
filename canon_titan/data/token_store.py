"""One logical token stream over several token arrays."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from canon_titan.data.documents import DataError


class TokenShard:
    """A token shard file read with ``os.pread``, as an array of ``tokens`` ids of ``dtype`` that
    supports ``len`` and slicing. A shard cut short while the run reads it (a truncated copy, a
    re-tokenization into the same folder) gives a short read, reported by name; a memory map of it
    would kill the process with SIGBUS at the first page past the new end."""

    def __init__(self, path: str | Path, dtype: np.dtype, tokens: int):
        self.path, self.dtype, self.tokens = str(path), np.dtype(dtype), tokens
        self._fd = os.open(self.path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.tokens

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self.tokens)
        if step != 1:
            raise ValueError(
                f"{self.path}: a shard is read in contiguous ranges, not with step {step}"
            )
        count = max(0, stop - start) * self.dtype.itemsize
        data = os.pread(self._fd, count, start * self.dtype.itemsize)
        if len(data) < count:
            raise DataError(
                f"{self.path} is {os.fstat(self._fd).st_size:,} bytes now, "
                f"{self.tokens * self.dtype.itemsize:,} when the run opened it: the shard "
                "was truncated or "
                "replaced while training read it. Restore it (or tokenize into a new "
                "folder) and run the "
                "same command to resume from the last checkpoint"
            )
        return np.frombuffer(data, dtype=self.dtype)

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


class TokenStore:
    """One logical token stream over several arrays (in memory, or token shards read from disk).
    With
    ``vocab_size``, every slice read is checked to lie inside the vocabulary, and a bad id is
    reported by shard name and offset (a damaged shard file)."""

    def __init__(
        self,
        arrays: list[np.ndarray | TokenShard],
        names: list[str] | None = None,
        vocab_size: int | None = None,
    ):
        keep = [i for i, a in enumerate(arrays) if len(a)]
        self.arrays = [arrays[i] for i in keep]
        self.names = [names[i] for i in keep] if names is not None else None
        self.vocab_size = vocab_size
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def slice(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces, position = [], start
        for index in range(first, len(self.arrays)):
            if position >= stop:
                break
            local = position - int(self.offsets[index])
            take = min(stop - position, len(self.arrays[index]) - local)
            piece = self.arrays[index][local : local + take]
            if self.vocab_size is not None and len(piece) and piece.max() >= self.vocab_size:
                bad = int(np.argmax(piece >= self.vocab_size))
                where = self.names[index] if self.names else f"token array {index}"
                raise DataError(
                    f"{where}: token id {int(piece[bad])} at offset {local + bad} is outside the "
                    f"vocabulary of {self.vocab_size} ids (a damaged shard?)"
                )
            pieces.append(piece)
            position += take
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
