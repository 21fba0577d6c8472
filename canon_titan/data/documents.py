"""Reading documents from the formats Nemotron-CC and similar corpora ship in.

JSON lines (``.jsonl``, ``.json``), zstd-compressed JSON lines (``.zst``, ``.jsonl.zst``) and
Parquet (``.parquet``), each record carrying the text under ``text_key``. A bad record (a line that
is not JSON, a missing text field, a truncated zstd stream) is reported with its file and line;
``on_error = "skip"`` counts and skips it instead of failing.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan.tools.logging import logger


class DataError(ValueError):
    pass


@dataclass
class ReadStats:
    documents: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)


def expand_inputs(patterns: list[str] | str) -> list[str]:
    patterns = [patterns] if isinstance(patterns, str) else patterns
    paths: list[str] = []
    if not patterns:
        return paths
    for pattern in patterns:
        matched = sorted(glob.glob(pattern, recursive=True))
        if not matched:
            raise DataError(f"{pattern!r} matches no file")
        paths.extend(matched)
    return paths


def _zstd_bytes(path: str) -> Iterator[bytes]:
    """Decompressed chunks of a (multi-frame) zstd file; a file cut inside a frame raises.

    zstandard's stream reader ends silently at a truncated frame, which would drop data unseen.
    """
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    obj, fed = dctx.decompressobj(), False
    with open(path, "rb") as raw:
        while chunk := raw.read(1 << 20):
            while chunk:
                fed = True
                out = obj.decompress(chunk)
                if out:
                    yield out
                if obj.eof:  # a frame ended; the rest starts the next one
                    chunk, obj, fed = obj.unused_data, dctx.decompressobj(), False
                else:
                    chunk = b""
    if fed and not obj.eof:
        raise DataError("truncated zstd stream (the file ends inside a frame)")


def _byte_lines(path: str) -> Iterator[bytes]:
    """The file's lines as bytes: split before decoding, so a bad byte costs only its own line."""
    if path.endswith(".zst"):
        pending = b""
        for chunk in _zstd_bytes(path):
            *complete, pending = (pending + chunk).split(b"\n")
            yield from complete
        if pending:
            yield pending
    else:
        with open(path, "rb") as f:
            for line in f:
                yield line.rstrip(b"\n")


def _json_records(path: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed record or the exception) for each non-empty line."""
    line_no = 0
    lines = _byte_lines(path)
    while True:
        try:
            raw = next(lines)
        except StopIteration:
            return
        except Exception as e:  # a truncated or corrupt zstd stream ends the file
            yield line_no + 1, DataError(f"{path}:{line_no + 1}: unreadable data after line {line_no} ({e})")
            return
        line_no += 1
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield line_no, DataError(f"{path}:{line_no}: not UTF-8 (byte {e.start + 1} of the line: "
                                     f"{raw[e.start:e.start + 1]!r})")
            continue
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as e:
            yield line_no, DataError(f"{path}:{line_no}: not a JSON object ({e.msg})")


def _parquet_records(path: str, text_key: str) -> Iterator[tuple[int, object]]:
    import pyarrow.parquet as pq

    try:
        table_file = pq.ParquetFile(path)
    except Exception as e:
        yield 1, DataError(f"{path}: not a readable Parquet file ({e})")
        return
    if text_key not in table_file.schema_arrow.names:
        yield 1, DataError(f"{path}: no column {text_key!r} (columns: {', '.join(table_file.schema_arrow.names)})")
        return
    row = 0
    for batch in table_file.iter_batches(columns=[text_key]):
        for value in batch.column(0).to_pylist():
            row += 1
            yield row, {text_key: value}


DATALOADER_SKIP = '[dataloader] on_error = "skip"'
"""How a training run skips bad records."""


def iter_documents(path: str, text_key: str = "text", on_error: str = "fail", stats: ReadStats | None = None,
                   skip_hint: str | None = None) -> Iterator[str]:
    """The texts of one file, in order; bad records raise DataError (saying how to skip them,
    ``skip_hint``, where the caller has a way) or are skipped (counted)."""
    stats = stats if stats is not None else ReadStats()
    records = _parquet_records(path, text_key) if path.endswith(".parquet") else _json_records(path)
    for line_no, record in records:
        problem = None
        if isinstance(record, DataError):
            problem = str(record)
        elif not isinstance(record, dict) or not isinstance(record.get(text_key), str):
            problem = f"{path}:{line_no}: missing the {text_key!r} text field"
        if problem is None:
            stats.documents += 1
            yield record[text_key]
            continue
        if on_error == "fail":
            raise DataError(f"{problem} (use {skip_hint} to skip bad records)" if skip_hint else problem)
        stats.skipped += 1
        if len(stats.problems) < 10:
            stats.problems.append(problem)
            logger.warning(f"skipping bad record: {problem}")


def file_kind(path: str) -> str:
    name = Path(path).name
    for suffix in (".jsonl.zst", ".json.zst", ".zst", ".jsonl", ".json", ".parquet"):
        if name.endswith(suffix):
            return suffix
    raise DataError(f"{path}: unknown format (expected .jsonl, .json, .jsonl.zst, .zst or .parquet)")
