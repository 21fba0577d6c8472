#!/usr/bin/env python
"""Data throughput per loader process vs what one GPU consumes.

Measures, in this one process: online tokenization (read documents + tokenize + BOS/EOS), the
pre-tokenization command, and batches read from pre-tokenized shards (``pread``,
``TokenStore.slice``). The required rate is computed from the model's training FLOPs per token at
40% MFU of an H100 (dense bf16 peak).

  .venv/bin/python scripts/benchmarks/bench_data.py  # built-in tokenizer
  .venv/bin/python scripts/benchmarks/bench_data.py --tokenizer-kind sentencepiece --tokenizer
      /path/llama2/tokenizer.model
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import zstandard

import model_registry
from canon_titan.data.builtin import ASSET_DIR, generate_corpus
from canon_titan.data.documents import iter_documents
from canon_titan.data.packed import PackedTextDataLoader
from canon_titan.data.pretokenize import tokenize_files
from canon_titan.data.tokenizers import build_tokenizer

H100_BF16_DENSE_PEAK = 989.5e12

REPO = Path(__file__).resolve().parents[2]


def required_tokens_per_second(
    model: str, flavor: str, seq_len: int, mfu: float
) -> tuple[float, int]:
    spec = model_registry.model_spec(model, flavor)
    with torch.device("meta"):
        module = spec.model.build()
    _, flops_per_token = spec.model.get_nparams_and_flops(module, seq_len)
    return mfu * H100_BF16_DENSE_PEAK / flops_per_token, flops_per_token


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokenizer-kind", default="hf", choices=["hf", "sentencepiece", "tiktoken"]
    )
    parser.add_argument("--tokenizer", help="tokenizer file or folder (default: the built-in one)")
    parser.add_argument(
        "--documents", type=int, default=20000, help="synthetic documents to generate"
    )
    parser.add_argument("--model", default="llama_canon")
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--mfu", type=float, default=0.4)
    args = parser.parse_args()

    tok_path = args.tokenizer or str(ASSET_DIR)
    tokenizer = build_tokenizer(args.tokenizer_kind, tok_path)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        lines = "".join(
            json.dumps({"text": t}) + "\n" for t in generate_corpus(args.documents, seed=1)
        )
        (work / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
        mb = len(lines) / 2**20

        start, tokens = time.perf_counter(), 0
        for text in iter_documents(str(work / "docs.jsonl.zst")):
            tokens += len(tokenizer.encode(text, add_bos=True, add_eos=True))
        online = tokens / (time.perf_counter() - start)

        start = time.perf_counter()
        tokenize_files(
            str(work / "docs.jsonl.zst"),
            work / "tokens",
            kind=args.tokenizer_kind,
            tokenizer_path=tok_path,
            workers=1,
            log=lambda m: None,
        )
        pretokenize = tokens / (time.perf_counter() - start)

        config = PackedTextDataLoader.Config(dataset="tokens", dataset_path=str(work / "tokens"))
        loader = PackedTextDataLoader(
            config,
            dp_world_size=1,
            dp_rank=0,
            tokenizer=tokenizer,
            seq_len=args.seq_len,
            local_batch_size=args.batch,
        )
        batches = iter(loader)
        start, read = time.perf_counter(), 0
        while time.perf_counter() - start < 3.0:
            read += next(batches)[1].numel()
        shard_batches = read / (time.perf_counter() - start)

    need, flops = required_tokens_per_second(args.model, args.flavor, args.seq_len, args.mfu)
    print(
        f"\ncorpus: {args.documents:,} synthetic documents, {mb:.1f} MB of JSON, {tokens:,} tokens "
        f"({args.tokenizer_kind} tokenizer, {tokenizer.get_vocab_size():,} ids)"
    )
    print(
        f"one GPU needs: {need:,.0f} tokens/s ({args.model} {args.flavor}, "
        f"{flops / 1e9:.2f} GFLOP per token at "
        f"seq {args.seq_len}, {args.mfu:.0%} MFU of an H100's "
        f"{H100_BF16_DENSE_PEAK / 1e12:.0f} TFLOP/s)"
    )
    print(f"{'path':<40} {'tokens/s':>12} {'x GPU need':>11}")
    for name, rate in (
        ("online: read .zst + tokenize", online),
        ("pre-tokenize command (1 worker)", pretokenize),
        (f"shard batches ({args.batch}x{args.seq_len})", shard_batches),
    ):
        print(f"{name:<40} {rate:>12,.0f} {rate / need:>11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
