"""Where packed documents start, in the layouts the sequence-mixing kernels take.

A batch of packed sequences [B, T] carries ``positions``: each token's position in its document, 0
at a document's first token (the data loaders' ``document_masking``; every row starts a document).
The kernels keep documents apart with it: each document's recurrent state starts from zero and a
convolution's taps stop at its first token, so a packed row computes what each of its documents
would alone.

- The torch kernels and the Canon op read ``positions`` on the device (elementwise masks, no host
  read).
- fla's varlen kernels take the batch flattened to one row and ``cu_seqlens`` [N + 1] (the
  documents' starts in it, then B * T), and the chunks their grids run over, ``chunk_indices``
  [chunks, 2] (each ``FLA_CHUNK``-token chunk's document and its index in it). Their sizes decide
  launch grids, so the host must know them: the data loaders build both with the batch
  (``document_boundaries``), and they reach the device in the step's queued copies. Built here
  from ``positions`` on the device instead (a model called without them: evaluation, tests), they
  cost a host read.
- mamba-ssm takes ``seq_idx`` [B, T], each token's document number in its row, made on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FLA_CHUNK = 64
"""The block length of fla's chunked GLA and gated-delta-rule kernels with document boundaries."""


def document_starts(positions: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: where documents start (position 0, and the first token of every row)."""
    starts = positions == 0
    starts[:, 0] = True
    return starts


def document_boundaries(positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """``cu_seqlens`` and ``chunk_indices`` (int32, on the host) of a [B, T] batch of
    ``positions``."""
    starts = document_starts(positions).reshape(-1).numpy()
    cu_seqlens = np.append(np.flatnonzero(starts), starts.size).astype(np.int32)
    chunks = -(-np.diff(cu_seqlens) // FLA_CHUNK)
    document = np.repeat(np.arange(len(chunks), dtype=np.int32), chunks)
    first = np.repeat(np.cumsum(chunks) - chunks, chunks)
    index = (np.arange(len(document)) - first).astype(np.int32)
    return {
        "cu_seqlens": torch.from_numpy(cu_seqlens),
        "chunk_indices": torch.from_numpy(np.stack([document, index], axis=1)),
    }


def one_document_a_row(batch: int, seq_len: int) -> dict[str, torch.Tensor]:
    """``document_boundaries`` of rows that are one document each, made by torch ops alone (the
    planner's batches are fake tensors, which have no values to read)."""
    chunks = -(-seq_len // FLA_CHUNK)
    chunk_indices = torch.stack(
        [
            torch.arange(batch, dtype=torch.int32).repeat_interleave(chunks),
            torch.arange(chunks, dtype=torch.int32).repeat(batch),
        ],
        dim=1,
    )
    return {
        "cu_seqlens": torch.arange(0, batch * seq_len + 1, seq_len, dtype=torch.int32),
        "chunk_indices": chunk_indices,
    }


@dataclass(frozen=True)
class Documents:
    """The documents of a packed batch (module docstring); ``cu_seqlens`` and ``chunk_indices`` as
    the data loaders send them, or None."""

    positions: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    chunk_indices: torch.Tensor | None = None

    def in_chunks(self, chunk_size: int) -> torch.Tensor:
        """[B, 1, N, chunk_size]: how many documents start in each token's chunk up to the token (0:
        the token's document entered the chunk with the state), the time axis cut as ``to_chunks``
        cuts it."""
        starts = document_starts(self.positions)
        pad = -starts.shape[1] % chunk_size
        if pad:  # the padding continues the last document (its keys and values are zero)
            starts = torch.cat([starts, starts.new_zeros(starts.shape[0], pad)], dim=1)
        return starts.unflatten(1, (-1, chunk_size)).cumsum(-1).unsqueeze(1)

    def fla_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_seqlens, chunk_indices) on the positions' device."""
        if self.cu_seqlens is not None:
            return self.cu_seqlens, self.chunk_indices
        # Host read: only a model called without the loaders' boundaries comes here.
        built = document_boundaries(self.positions.cpu())
        return built["cu_seqlens"].to(self.positions.device), built["chunk_indices"].to(
            self.positions.device
        )

    def seq_idx(self) -> torch.Tensor:
        """[B, T] int32: each token's document number in its row (mamba-ssm's ``seq_idx``)."""
        return (
            torch.cumsum(document_starts(self.positions), dim=1, dtype=torch.int32) - 1
        ).contiguous()

    def row_ends(self) -> torch.Tensor:
        """[B]: the number of each row's last document in the flattened batch (fla's final
        states)."""
        return torch.cumsum(document_starts(self.positions).sum(1), 0) - 1


def kept(t: torch.Tensor, masks: dict | None, name: str) -> torch.Tensor:
    """``t`` where ``masks[name]`` (its leading dims) holds, else 0; without documents ``t`` itself:
    the ops, and so the bits, of the kernel before it kept documents apart."""
    if masks is None:
        return t
    mask = masks[name]
    return t * mask.reshape(*mask.shape, *(1,) * (t.dim() - mask.dim()))


def separate(documents: Documents | None, chunk_size: int) -> dict | None:
    """The masks a chunked torch kernel applies to keep documents apart (None without documents),
    each broadcasting against [B, H, N, C] (``to_chunks``' layout):

    - ``fresh``: where a token's document entered its chunk with the state (it reads the entering
      state);
    - ``last``: where a token is in its chunk's last document (it writes the leaving state);
    - ``carried`` [B, 1, N]: where the chunk holds no document start (the entering state passes
      through);
    - ``same`` [B, 1, N, C, C]: where two tokens of a chunk are in one document."""
    if documents is None:
        return None
    seg = documents.in_chunks(chunk_size)
    return {
        "fresh": seg == 0,
        "last": seg == seg[..., -1:],
        "carried": seg[..., -1] == 0,
        "same": seg.unsqueeze(-1) == seg.unsqueeze(-2),
    }
