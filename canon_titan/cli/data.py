"""``canon-titan data tokenize|inspect|capo-people|synthetic|multihop``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
from pathlib import Path

import numpy as np

from canon_titan.cli.common import BUILTIN_TOKENIZER, OVERRIDES, fail, parse_with_overrides
from canon_titan.config import ConfigError, load
from canon_titan.data.builtin import ASSET_DIR
from canon_titan.data.documents import DataError
from canon_titan.data.inputs import DataConfigError
from canon_titan.data.pretokenize import open_shards, read_index, shard_problem, tokenize_files
from canon_titan.data.synthetic import SyntheticDataLoader, loader_config
from canon_titan.data.tokenizers import build_tokenizer
from canon_titan.evaluation import multihop
from canon_titan.evaluation.lm_tasks import MULTIHOP_CONTEXTS, MULTIHOP_HOPS
from canon_titan.evaluation.synthetic import DEFAULT_TEST_SEED
from canon_titan.tools.fileio import write_atomic
from synthetic_data import capo


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="canon-titan data")
    sub = parser.add_subparsers(dest="action", required=True)
    tok = sub.add_parser(
        "tokenize", help="document files -> memory-mappable token shards (resumable)"
    )
    tok.add_argument(
        "--input", action="append", required=True, help="glob of .jsonl/.json/.zst/.parquet files"
    )
    tok.add_argument("--out", required=True)
    tok.add_argument(
        "--tokenizer",
        help=f"{BUILTIN_TOKENIZER} (the built-in tokenizer, kind hf) "
        "unless given, as for [tokenizer] path: a tokenizer file or folder",
    )
    tok.add_argument(
        "--tokenizer-kind",
        choices=["hf", "sentencepiece", "tiktoken"],
        default="hf",
        help="hf (default), sentencepiece (Llama-2's tokenizer.model) or tiktoken (Llama-3's)",
    )
    tok.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    tok.add_argument("--text-key", default="text")
    tok.add_argument("--on-error", choices=["fail", "skip"], default="fail")
    inspect = sub.add_parser(
        "inspect",
        help="token counts per shard, problems, and decoded samples; exit 2 if a "
        "shard is missing, has the wrong size or ids outside the vocabulary",
    )
    inspect.add_argument("folder")
    inspect.add_argument("--samples", type=int, default=2)
    inspect.add_argument("--max-chars", type=int, default=400)
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="also read every shard: recorded checksums and the largest id actually stored",
    )
    people = sub.add_parser(
        "capo-people",
        epilog=OVERRIDES,
        help="the Capo population of a config as JSON lines, with a "
        "prompt per person for writing bioR biographies",
    )
    people.add_argument(
        "--config", required=True, help="a TOML with [dataloader] dataset = 'capo_bios'"
    )
    people.add_argument("--out", required=True)
    syn = sub.add_parser(
        "synthetic",
        epilog=OVERRIDES,
        help="samples of a synthetic task as JSON lines: the training samples the "
        "dataloader draws (token ids, answer and loss masks), or the held-out test items",
    )
    syn.add_argument("task", help="depo1, depo2, brevo1, brevo2, mano, lano or capo_bios")
    syn.add_argument(
        "--n", type=int, required=True, help="training samples, or test items per group with --test"
    )
    syn.add_argument("--out", required=True)
    syn.add_argument(
        "--test", action="store_true", help="the held-out test items that eval synthetic scores"
    )
    syn.add_argument(
        "--config",
        help="a run's TOML whose task section, tokenizer, seq_len and seeds apply "
        "(default: the built-in debug config with seq_len 2048, room for every preset)",
    )
    syn.add_argument(
        "--seed",
        type=int,
        help="[dataloader] seed for training samples (default: the config's), or "
        "the test set's seed with --test (default: eval synthetic's)",
    )
    hop = sub.add_parser(
        "multihop",
        help="multi-hop birth-year test file: people's birth years scattered in "
        "background text (JSON lines: prompt, answer)",
    )
    hop.add_argument(
        "--background",
        required=True,
        help="plain text, or documents (.jsonl/.zst/.parquet) with --text-key",
    )
    hop.add_argument(
        "--text-key",
        default="text",
        help="document field holding the text (reference Wikipedia: plaintext)",
    )
    where = hop.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="one test file, for --hops/--context-tokens")
    where.add_argument(
        "--out-dir",
        help="the reference grid for the eval/ tasks: OUT_DIR/multihop/{1hop,2hop}_"
        "{0k,0.5k,1k,2k,3k,4k,5k,6k}.jsonl (1-hop N=5, 2-hop N=3; k = 1024 tokens)",
    )
    hop.add_argument(
        "--hops", type=int, default=1, help="k: 1 (people per group 5 by default) or 2 (3)"
    )
    hop.add_argument(
        "--people", type=int, help="n, people per group (default 5 for 1 hop, 3 otherwise)"
    )
    hop.add_argument(
        "--context-tokens", type=int, default=0, help="M: background tokens stay below this"
    )
    hop.add_argument("--count", type=int, default=200)
    hop.add_argument("--seed", type=int, default=42)
    hop.add_argument("--tokenizer", help="tokenizer counting M (default: the built-in one)")
    hop.add_argument("--tokenizer-kind", choices=["hf", "sentencepiece", "tiktoken"], default="hf")
    args, overrides = parse_with_overrides(parser, argv)
    if args.action == "multihop":
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        return _multihop(args)
    if overrides and args.action not in ("capo-people", "synthetic"):
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    if args.action == "capo-people":
        return _capo_people(args, overrides)
    if args.action == "synthetic":
        return _synthetic_samples(args, overrides)

    try:
        if args.action == "tokenize":
            if args.tokenizer is None and args.tokenizer_kind != "hf":
                return fail(
                    "data",
                    f"--tokenizer-kind {args.tokenizer_kind} needs --tokenizer "
                    "(its file); without --tokenizer the built-in tokenizer (kind "
                    "hf) is used",
                )
            index = tokenize_files(
                args.input,
                args.out,
                kind=args.tokenizer_kind,
                tokenizer_path=args.tokenizer or str(BUILTIN_TOKENIZER),
                workers=args.workers,
                text_key=args.text_key,
                on_error=args.on_error,
            )
            skipped = sum(s["skipped"] for s in index["shards"])
            print(
                f"[tokenize] done: {sum(s['tokens'] for s in index['shards']):,} tokens in "
                f"{len(index['shards'])} shards at {args.out}"
                + (f"; skipped {skipped} bad records" if skipped else "")
            )
            return 0
        return _inspect_tokens(args)
    except (DataError, FileNotFoundError) as e:
        return fail("data", e)


def _inspect_tokens(args) -> int:

    index = read_index(args.folder)
    tok_info, dtype = index["tokenizer"], np.dtype(index["dtype"])
    vocab = tok_info["vocab_size"]
    print(
        f"{args.folder}: tokenizer {tok_info['kind']} {tok_info['path']} ({vocab} ids), "
        f"dtype {dtype}"
    )
    print(f"{'shard':<12} {'tokens':>14} {'documents':>10} {'skipped':>8}  source")
    problems = []
    for shard in index["shards"]:
        print(
            f"{shard['shard']:<12} {shard['tokens']:>14,} {shard['documents']:>10,} "
            f"{shard['skipped']:>8}  "
            f"{shard['source']}"
        )
        path = Path(args.folder) / shard["shard"]
        problem = shard_problem(path, shard, dtype.itemsize, checksum=args.verify, vocab_size=vocab)
        if problem:
            problems.append(problem)
        if (
            args.verify
            and shard["tokens"]
            and path.is_file()
            and path.stat().st_size == shard["tokens"] * dtype.itemsize
        ):
            stored = np.memmap(path, dtype=dtype, mode="r")
            outside = int((stored >= vocab).sum())
            if outside:
                problems.append(
                    f"{path} holds {outside} token ids outside the vocabulary of {vocab} "
                    f"(largest {int(stored.max())})"
                )
    total = sum(s["tokens"] for s in index["shards"])
    print(f"{'total':<12} {total:>14,} {sum(s['documents'] for s in index['shards']):>10,}")
    for problem in problems:
        print(f"PROBLEM {problem}", file=sys.stderr)
    if args.samples and not problems:
        tokenizer = build_tokenizer(tok_info["kind"], tok_info["path"])
        store = open_shards(args.folder, tokenizer)
        stream = store.slice(0, min(len(store), 200_000)).tolist()
        documents, current = [], []
        for token in stream:
            current.append(token)
            if token == tok_info["eos_id"]:
                documents.append(current)
                current = []
                if len(documents) == args.samples:
                    break
        for i, doc in enumerate(documents):
            text = tokenizer.decode(
                [t for t in doc if t not in (tok_info["bos_id"], tok_info["eos_id"])]
            )
            print(f"--- document {i} ({len(doc)} tokens)\n{text[: args.max_chars]}")
    return 2 if problems else 0


def _multihop(args) -> int:

    if args.hops < 1 or args.count < 1 or args.context_tokens < 0:
        return fail("data", "--hops and --count must be >= 1, --context-tokens >= 0")
    if args.out_dir:
        jobs = [
            (Path(args.out_dir) / "multihop" / f"{hops}_{label}.jsonl", n, k, tokens)
            for hops, (n, k) in MULTIHOP_HOPS.items()
            for label, tokens in MULTIHOP_CONTEXTS.items()
        ]
    else:
        jobs = [
            (
                Path(args.out),
                args.people or (5 if args.hops == 1 else 3),
                args.hops,
                args.context_tokens,
            )
        ]
    try:
        tokenizer = build_tokenizer(args.tokenizer_kind, args.tokenizer or str(ASSET_DIR))
        background = multihop.read_background(args.background, args.text_key)
        for out, n, k, tokens in jobs:
            records = multihop.generate(
                n,
                k,
                tokens,
                args.count,
                args.seed,
                background,
                lambda text: len(tokenizer.encode(text, add_bos=False, add_eos=False)),
            )
            out.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(out, "".join(json.dumps(r) + "\n" for r in records))
            print(
                f"[multihop] {len(records)} prompts ({k}-hop, N={n}, < {tokens} background "
                f"tokens) -> {out}"
            )
    except (OSError, ValueError) as e:
        return fail("data", e)
    return 0


def _synthetic_samples(args, overrides: list[str]) -> int:

    if args.n < 1:
        return fail("data", "--n must be >= 1")
    config = args.config or str(
        Path(__file__).resolve().parents[2] / "train_configs" / "llama_debug.toml"
    )
    base = [] if args.config else ["--training.seq_len", "2048"]
    seed = [] if args.seed is None or args.test else ["--dataloader.seed", str(args.seed)]
    try:
        run = load(config, [*base, "--dataloader.dataset", args.task, *seed, *overrides])
    except ConfigError as e:
        return fail("config", e)

    lines = []
    try:
        loader = SyntheticDataLoader(
            loader_config(run),
            dp_world_size=1,
            dp_rank=0,
            tokenizer=run_tokenizer(run),
            seq_len=run["training"]["seq_len"],
            local_batch_size=1,
        )
        if args.test:
            for item in loader.task.test_items(
                DEFAULT_TEST_SEED if args.seed is None else args.seed, args.n
            ):
                lines.append({"group": item.group, "prompt": item.prompt, "answer": item.answer})
        else:
            for window, sample, tokens, flags in loader.samples():
                record = {
                    "sample": list(sample),
                    "window": window,
                    "tokens": tokens,
                    "loss_mask": flags,
                }
                generated = loader.task.train_sample(loader.stream(sample))
                if hasattr(generated, "labels"):
                    record["answer_mask"] = generated.labels
                else:
                    record["text"] = generated
                lines.append(record)
                if len(lines) == args.n:
                    break
    except DataConfigError as e:
        return fail("data", e)
    write_atomic(args.out, "".join(json.dumps(line) + "\n" for line in lines))
    what = (
        "test items"
        if args.test
        else "training samples (in the order the dataloader trains on them)"
    )
    print(f"[synthetic] {len(lines)} {args.task} {what} ({loader.task.params}) -> {args.out}")
    return 0


def run_tokenizer(run):
    return build_tokenizer(run["tokenizer"]["kind"], run["tokenizer"]["path"] or str(ASSET_DIR))


def _capo_people(args, overrides: list[str]) -> int:

    try:
        run = load(args.config, overrides, environment=False)
    except ConfigError as e:
        return fail("config", e)
    if run["dataloader"]["dataset"] != "capo_bios":
        return fail(
            "config",
            f"{args.config}: [dataloader] dataset must be 'capo_bios', not "
            f"{run['dataloader']['dataset']!r}",
        )
    params = capo.CapoParams(**{k: v for k, v in run["capo"].items() if v is not None})
    rng = random.Random(f"bior-prompts/{params.population_seed}")
    lines = [
        json.dumps(
            {
                **dataclasses.asdict(p),
                "name": p.name,
                "pronoun": p.pronoun,
                "prompt": capo.bior_prompt(p, rng),
            }
        )
        for p in capo.population(params)
    ]
    write_atomic(args.out, "\n".join(lines) + "\n")
    print(
        f'[capo] {len(lines)} people -> {args.out}; write bioR lines as {{"id": ..., "text": ...}} '
        "and set [capo] bior_path"
    )
    return 0
