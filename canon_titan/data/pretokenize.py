"""Pre-tokenization: document files -> token shards that training memory-maps.

``canon-titan data tokenize --input GLOB --tokenizer PATH --out DIR`` writes, per input file, a
shard ``NNNNN.bin`` (raw token ids, uint16 when the vocabulary fits, else uint32; each document
wrapped in BOS/EOS) and a sidecar ``NNNNN.json``; the sidecar is written last (atomically), so a
shard counts as done only once complete, and re-running skips finished shards (resumable). Files
are tokenized in parallel worker processes. ``index.json`` lists the shards and the tokenizer.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from canon_titan.data.documents import DataError, ReadStats, expand_inputs, file_kind, iter_documents
from canon_titan.fileio import write_atomic

INDEX = "index.json"
FORMAT = "canon-titan-tokens-v1"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


_worker_tokenizer = None


def _init_worker(kind: str, path: str) -> None:
    global _worker_tokenizer
    from canon_titan.data.tokenizers import build_tokenizer

    _worker_tokenizer = build_tokenizer(kind, path)


def _tokenize_file(job: tuple) -> dict:
    index, source, out_dir, text_key, on_error = job
    tok = _worker_tokenizer
    dtype = token_dtype(tok.get_vocab_size())
    stats = ReadStats()
    out_dir = Path(out_dir)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{index:05d}.bin.")
    tokens = 0
    with os.fdopen(fd, "wb") as f:
        for text in iter_documents(source, text_key, on_error, stats):
            ids = np.asarray(tok.encode(text, add_bos=True, add_eos=True), dtype=dtype)
            f.write(ids.tobytes())
            tokens += len(ids)
    os.chmod(tmp, 0o644)
    os.replace(tmp, out_dir / f"{index:05d}.bin")
    info = {"shard": f"{index:05d}.bin", "source": source, "tokens": tokens,
            "documents": stats.documents, "skipped": stats.skipped, "problems": stats.problems}
    write_atomic(out_dir / f"{index:05d}.json", (json.dumps(info, indent=1) + "\n").encode())
    return info


def tokenize_files(inputs: list[str] | str, out_dir: str | Path, *, kind: str, tokenizer_path: str,
                   workers: int = 1, text_key: str = "text", on_error: str = "fail", log=print) -> dict:
    from canon_titan.data.tokenizers import build_tokenizer

    sources = expand_inputs(inputs)
    for source in sources:
        file_kind(source)
    tok = build_tokenizer(kind, tokenizer_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_info = {"kind": kind, "path": str(Path(tokenizer_path).resolve()), "vocab_size": tok.get_vocab_size(),
                      "bos_id": tok.bos_id, "eos_id": tok.eos_id}
    previous = out_dir / INDEX
    if previous.is_file():
        old = json.loads(previous.read_text())
        if old["tokenizer"]["vocab_size"] != tokenizer_info["vocab_size"] or old["tokenizer"]["kind"] != kind:
            raise DataError(f"{out_dir} holds tokens of another tokenizer ({old['tokenizer']}); use a new --out")
    done, jobs = {}, []
    for index, source in enumerate(sources):
        sidecar = out_dir / f"{index:05d}.json"
        if sidecar.is_file() and json.loads(sidecar.read_text())["source"] == source:
            done[index] = json.loads(sidecar.read_text())
        else:
            jobs.append((index, source, str(out_dir), text_key, on_error))
    if done:
        log(f"[tokenize] {len(done)} of {len(sources)} files already done, resuming")
    start, total_tokens = time.perf_counter(), 0
    context = get_context("spawn")
    with context.Pool(max(1, min(workers, len(jobs) or 1)), initializer=_init_worker,
                      initargs=(kind, tokenizer_path)) as pool:
        for n, info in enumerate(pool.imap_unordered(_tokenize_file, jobs), 1):
            done[int(info["shard"][:5])] = info
            total_tokens += info["tokens"]
            elapsed = time.perf_counter() - start
            eta = elapsed / n * (len(jobs) - n)
            log(f"[tokenize] {len(done)}/{len(sources)} files, {total_tokens:,} tokens, "
                f"{total_tokens / elapsed:,.0f} tokens/s, ETA {eta:.0f}s ({info['source']})")
    index = {"format": FORMAT, "tokenizer": tokenizer_info, "dtype": str(token_dtype(tok.get_vocab_size())),
             "shards": [done[i] for i in range(len(sources))]}
    write_atomic(out_dir / INDEX, (json.dumps(index, indent=1) + "\n").encode())
    return index


def read_index(folder: str | Path) -> dict:
    path = Path(folder) / INDEX
    if not path.is_file():
        raise DataError(f"{folder} has no {INDEX}: not a token folder written by `canon-titan data tokenize`")
    index = json.loads(path.read_text())
    if index.get("format") != FORMAT:
        raise DataError(f"{path}: unknown format {index.get('format')!r}")
    return index


def open_shards(folder: str | Path, tokenizer=None):
    """The shards as one memory-mapped TokenStore, checked against the training tokenizer."""
    from canon_titan.data.packed import TokenStore

    index = read_index(folder)
    if tokenizer is not None and tokenizer.get_vocab_size() != index["tokenizer"]["vocab_size"]:
        raise DataError(f"{folder} was tokenized with a {index['tokenizer']['vocab_size']}-id tokenizer "
                        f"({index['tokenizer']['path']}), training uses {tokenizer.get_vocab_size()} ids")
    dtype = np.dtype(index["dtype"])
    arrays = []
    for shard in index["shards"]:
        path = Path(folder) / shard["shard"]
        if path.stat().st_size != shard["tokens"] * dtype.itemsize:
            raise DataError(f"{path}: {path.stat().st_size} bytes, the index says {shard['tokens']} tokens")
        if shard["tokens"]:
            arrays.append(np.memmap(path, dtype=dtype, mode="r"))
    return TokenStore(arrays)
