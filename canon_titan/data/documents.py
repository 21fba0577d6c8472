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

from canon_titan.tools.fileio import read_from


class DataError(ValueError):
    pass


class MissingTextColumn(DataError):
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
            raise DataError(f"{pattern!r} matches no file{read_from(pattern)}")
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
            yield (
                line_no + 1,
                DataError(f"{path}:{line_no + 1}: unreadable data after line {line_no} ({e})"),
            )
            return
        line_no += 1
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield (
                line_no,
                DataError(
                    f"{path}:{line_no}: not UTF-8 (byte {e.start + 1} of the line: "
                    f"{raw[e.start : e.start + 1]!r})"
                ),
            )
            continue
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as e:
            yield line_no, DataError(f"{path}:{line_no}: not a JSON object ({e.msg})")


def _parquet_records(
    path: str, text_key: str, key_hint: str | None
) -> Iterator[tuple[int, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table_file = pq.ParquetFile(path)
    except Exception as e:
        yield 1, DataError(f"{path}: not a readable Parquet file ({e})")
        return
    schema = table_file.schema_arrow
    if text_key not in schema.names:
        texts = [
            f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
        ]
        hint = (
            f"; set {key_hint.format(texts[0])} if its text is there" if texts and key_hint else ""
        )
        yield (
            1,
            MissingTextColumn(
                f"{path}: no column {text_key!r} (columns: {', '.join(schema.names)}){hint}"
            ),
        )
        return
    row = 0
    batches = table_file.iter_batches(columns=[text_key])
    while True:
        try:
            batch = next(batches, None)
        except (OSError, pa.ArrowException) as e:  # a damaged data page under an intact footer
            yield (
                row + 1,
                DataError(
                    f"{path}: rows from {row + 1} on cannot be read: damaged Parquet data ({e})"
                ),
            )
            return
        if batch is None:
            return
        for value in batch.column(0).to_pylist():
            row += 1
            yield row, {text_key: value}


DATALOADER_SKIP = '[dataloader] on_error = "skip"'
"""How a training run skips bad records."""
DATALOADER_KEY = '[dataloader] text_key = "{}"'
"""How a training run names the field its documents' text is in."""


def missing_text(where: str, record: dict, text_key: str, key_hint: str | None) -> str:
    """A record without a string ``text_key``: its fields, and the one its text is likely in (the
    longest string) in the caller's spelling ``key_hint`` (a format of the field's name)."""
    fields = list(record)
    shown = ", ".join(map(repr, fields[:12])) + (
        f" (and {len(fields) - 12} more)" if len(fields) > 12 else ""
    )
    strings = {k: len(v) for k, v in record.items() if isinstance(v, str) and k != text_key}
    what = "not a string" if text_key in record else "missing"
    problem = (
        f"{where}: the {text_key!r} text field is {what}; the record's fields: {shown or 'none'}"
    )
    if strings and key_hint:
        problem += f"; set {key_hint.format(max(strings, key=strings.get))} if its text is there"
    return problem


def iter_documents(
    path: str,
    text_key: str = "text",
    on_error: str = "fail",
    stats: ReadStats | None = None,
    skip_hint: str | None = None,
    key_hint: str | None = None,
) -> Iterator[str]:
    """The texts of one file, in order; bad records raise DataError (saying how to skip them,
    ``skip_hint``, where the caller has a way) or are skipped (counted). A record without the text
    field names the fields it has, and the one to use in the caller's spelling (``key_hint``, a
    format of the field's name); skipping is offered only once some record had the field (otherwise
    the field is the wrong one, and skipping would skip every record)."""
    stats = stats if stats is not None else ReadStats()
    records = (
        _parquet_records(path, text_key, key_hint)
        if path.endswith(".parquet")
        else _json_records(path)
    )
    for line_no, record in records:
        problem, wrong_key = None, False
        if isinstance(record, DataError):
            problem = str(record)
            wrong_key = isinstance(record, MissingTextColumn)
        elif not isinstance(record, dict):
            problem = f"{path}:{line_no}: not a JSON object (a JSON {type(record).__name__})"
        elif not isinstance(record.get(text_key), str):
            problem = missing_text(f"{path}:{line_no}", record, text_key, key_hint)
            wrong_key = stats.documents == 0
        if problem is None:
            stats.documents += 1
            yield record[text_key]
            continue
        if on_error == "fail":
            offer = skip_hint and not wrong_key
            raise DataError(
                f"{problem} (use {skip_hint} to skip bad records)" if offer else problem
            )
        stats.skipped += 1
        if len(stats.problems) < 10:
            stats.problems.append(problem)
            logger.warning(f"skipping bad record: {problem}")


def file_kind(path: str) -> str:
    name = Path(path).name
    for suffix in (".jsonl.zst", ".json.zst", ".zst", ".jsonl", ".json", ".parquet"):
        if name.endswith(suffix):
            return suffix
    raise DataError(
        f"{path}: unknown format (expected .jsonl, .json, .jsonl.zst, .zst or .parquet)"
    )
