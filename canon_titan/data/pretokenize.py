"""Pre-tokenization: document files -> token shards that training reads by offset.

``canon-titan data tokenize --input GLOB --tokenizer PATH --out DIR`` writes, per input file, a
shard ``NNNNN.bin`` (raw token ids, uint16 when the vocabulary fits, else uint32; each document
wrapped in BOS/EOS) and a sidecar ``NNNNN.json`` (token count, largest id, BLAKE2b checksum); the
sidecar is written last (atomically), so a shard counts as done only once complete. Re-running
skips finished shards whose file still matches its sidecar (size and checksum) and tokenizes the
others again (resumable). Files are tokenized in parallel worker processes. ``index.json`` lists
the shards and the tokenizer. Opening the shards for training checks their sizes and that every
id is inside the training vocabulary (from the recorded largest id); every read checks that the
shard still holds what it read (``TokenShard``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from canon_titan.data.documents import (
    DataError,
    ReadStats,
    expand_inputs,
    file_kind,
    iter_documents,
)
from canon_titan.data.token_store import TokenShard, TokenStore
from canon_titan.data.tokenizers import build_tokenizer
from canon_titan.tools.fileio import write_atomic

INDEX = "index.json"
FORMAT = "canon-titan-tokens-v1"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


_worker_tokenizer = None


def _init_worker(kind: str, path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(kind, path)


def _tokenize_file(job: tuple) -> dict:
    index, source, out_dir, text_key, on_error = job
    tok = _worker_tokenizer
    dtype = token_dtype(tok.get_vocab_size())
    stats = ReadStats()
    out_dir = Path(out_dir)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{index:05d}.bin.")
    tokens, max_id, digest = 0, -1, hashlib.blake2b(digest_size=16)
    try:
        with os.fdopen(fd, "wb") as f:
            for text in iter_documents(
                source,
                text_key,
                on_error,
                stats,
                skip_hint="--on-error skip",
                key_hint="--text-key {}",
            ):
                ids = np.asarray(tok.encode(text, add_bos=True, add_eos=True), dtype=dtype)
                data = ids.tobytes()
                f.write(data)
                digest.update(data)
                tokens += len(ids)
                max_id = max(max_id, int(ids.max())) if len(ids) else max_id
    except BaseException:
        os.unlink(tmp)  # a file that failed leaves no partial shard
        raise
    os.chmod(tmp, 0o644)
    os.replace(tmp, out_dir / f"{index:05d}.bin")
    info = {
        "shard": f"{index:05d}.bin",
        "source": source,
        "tokens": tokens,
        "max_id": max_id,
        "blake2b": digest.hexdigest(),
        "documents": stats.documents,
        "skipped": stats.skipped,
        "problems": stats.problems,
    }
    write_atomic(out_dir / f"{index:05d}.json", (json.dumps(info, indent=1) + "\n").encode())
    return info


def tokenize_files(
    inputs: list[str] | str,
    out_dir: str | Path,
    *,
    kind: str,
    tokenizer_path: str,
    workers: int = 1,
    text_key: str = "text",
    on_error: str = "fail",
    log=print,
) -> dict:
    sources = expand_inputs(inputs)
    for source in sources:
        file_kind(source)
    tok = build_tokenizer(kind, tokenizer_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_info = {
        "kind": kind,
        "path": str(Path(tokenizer_path).resolve()),
        "vocab_size": tok.get_vocab_size(),
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
    }
    previous = out_dir / INDEX
    if previous.is_file():
        old = json.loads(previous.read_text())
        if (
            old["tokenizer"]["vocab_size"] != tokenizer_info["vocab_size"]
            or old["tokenizer"]["kind"] != kind
        ):
            raise DataError(
                f"{out_dir} holds tokens of another tokenizer ({old['tokenizer']}); use a new --out"
            )
    done, jobs = {}, []
    itemsize = token_dtype(tok.get_vocab_size()).itemsize
    for index, source in enumerate(sources):
        sidecar = out_dir / f"{index:05d}.json"
        info = _read_sidecar(sidecar)
        if info is not None and info.get("source") == source:
            problem = shard_problem(out_dir / info["shard"], info, itemsize, checksum=True)
            if problem is None:
                done[index] = info
                continue
            log(f"[tokenize] {problem}: tokenizing {source} again")
        jobs.append((index, source, str(out_dir), text_key, on_error))
    if done:
        log(f"[tokenize] {len(done)} of {len(sources)} files already done, resuming")
    start, total_tokens = time.perf_counter(), 0
    context = get_context("spawn")
    with context.Pool(
        max(1, min(workers, len(jobs) or 1)),
        initializer=_init_worker,
        initargs=(kind, tokenizer_path),
    ) as pool:
        for n, info in enumerate(pool.imap_unordered(_tokenize_file, jobs), 1):
            done[int(info["shard"][:5])] = info
            total_tokens += info["tokens"]
            elapsed = time.perf_counter() - start
            eta = elapsed / n * (len(jobs) - n)
            log(
                f"[tokenize] {len(done)}/{len(sources)} files, {total_tokens:,} tokens, "
                f"{total_tokens / elapsed:,.0f} tokens/s, ETA {eta:.0f}s ({info['source']})"
            )
    index = {
        "format": FORMAT,
        "tokenizer": tokenizer_info,
        "dtype": str(token_dtype(tok.get_vocab_size())),
        "shards": [done[i] for i in range(len(sources))],
    }
    write_atomic(out_dir / INDEX, (json.dumps(index, indent=1) + "\n").encode())
    return index


def _read_sidecar(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (ValueError, OSError):
        return None  # a damaged sidecar: the shard is made again


def shard_problem(
    path: Path, info: dict, itemsize: int, *, checksum: bool = False, vocab_size: int | None = None
) -> str | None:
    """What is wrong with a finished shard against its record (missing, wrong size, ids outside
    the vocabulary, with ``checksum`` also changed bytes), or None."""
    if not path.is_file():
        return f"{path} is missing"
    size, expected = path.stat().st_size, info["tokens"] * itemsize
    if size != expected:
        return (
            f"{path} has {size} bytes, its record says {info['tokens']} tokens ({expected} bytes)"
        )
    if vocab_size is not None and info.get("max_id", -1) >= vocab_size:
        return (
            f"{path} holds token id {info['max_id']}, outside the training vocabulary of "
            f"{vocab_size} ids "
            "(tokenized with another tokenizer?)"
        )
    if checksum and "blake2b" in info:
        digest = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
        if digest.hexdigest() != info["blake2b"]:
            return f"{path} does not match its recorded checksum (changed since it was written)"
    return None


def read_index(folder: str | Path) -> dict:
    path = Path(folder) / INDEX
    if not path.is_file():
        raise DataError(
            f"{folder} has no {INDEX}: not a token folder written by `canon-titan data tokenize`"
        )
    try:
        index = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise DataError(f"{path}: not a readable token index ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(
            f"{path}: unknown format {index.get('format') if isinstance(index, dict) else None!r}"
        )
    return index


def open_shards(folder: str | Path, tokenizer=None):
    """The shards as one TokenStore read from disk, checked against the training tokenizer."""
    index = read_index(folder)
    if tokenizer is not None and tokenizer.get_vocab_size() != index["tokenizer"]["vocab_size"]:
        raise DataError(
            f"{folder} was tokenized with a {index['tokenizer']['vocab_size']}-id tokenizer "
            f"({index['tokenizer']['path']}), training uses {tokenizer.get_vocab_size()} ids"
        )
    dtype = np.dtype(index["dtype"])
    vocab = (
        tokenizer.get_vocab_size() if tokenizer is not None else index["tokenizer"]["vocab_size"]
    )
    arrays, names = [], []
    for shard in index["shards"]:
        path = Path(folder) / shard["shard"]
        problem = shard_problem(path, shard, dtype.itemsize, vocab_size=vocab)
        if problem:
            raise DataError(problem)
        if shard["tokens"]:
            arrays.append(TokenShard(path, dtype, shard["tokens"]))
            names.append(str(path))
    return TokenStore(arrays, names=names, vocab_size=vocab)
