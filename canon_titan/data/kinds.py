"""The kinds of ``[dataloader] dataset``: which loader reads each, and which ``[dataloader]`` keys
it reads (besides ``dataset``, ``seed`` and ``answer_only_loss``, which every kind has)."""

from __future__ import annotations

from synthetic_data.tasks import SECTION

_EVERY = frozenset({"pin_memory"})
_TEXT = _EVERY | {"text_key", "on_error", "add_bos", "add_eos", "document_masking", "num_workers"}
PACKED = {
    "builtin": _TEXT | {"shuffle", "infinite"},
    "files": _TEXT | {"dataset_path", "shuffle", "infinite"},
    "tokens": _EVERY | {"dataset_path", "shuffle", "infinite", "document_masking", "num_workers"},
}
"""Packed token windows (``PackedTextDataLoader``): the built-in corpus, document files, token
folders."""
STREAM = {"stream": _TEXT | {"sources", "weights", "shuffle_buffer"}}
"""Documents tokenized while training (``StreamingTextDataLoader``)."""
SYNTHETIC = {name: _EVERY for name in SECTION}
"""The synthetic playground tasks (``SyntheticDataLoader``), with their parameters in
``[SECTION[name]]``."""
DATASET_KINDS: dict[str, frozenset[str]] = {**PACKED, **STREAM, **SYNTHETIC}
