"""One logical token stream over several token arrays."""

from __future__ import annotations

import numpy as np

from canon_titan.data.documents import DataError


class TokenStore:
    """One logical token stream over several arrays (in memory or memory-mapped shards). With
    ``vocab_size``, every slice read is checked to lie inside the vocabulary, and a bad id is
    reported by shard name and offset (a damaged shard file)."""

    def __init__(self, arrays: list[np.ndarray], names: list[str] | None = None, vocab_size: int | None = None):
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
                raise DataError(f"{where}: token id {int(piece[bad])} at offset {local + bad} is outside the "
                                f"vocabulary of {self.vocab_size} ids (a damaged shard?)")
            pieces.append(piece)
            position += take
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
