"""The ``canon-titan`` command.

  canon-titan train --config FILE.toml [--nproc N] [--section.key value ...]
  canon-titan config show FILE.toml [--static] [--section.key value ...]
  canon-titan config validate FILE.toml [FILE.toml ...] [--static] [--world-size N] [--section.key value ...]
  canon-titan convert to-hf CKPT_DIR OUT_DIR --config FILE.toml [--dtype fp32|bf16|fp16] [--rope-layout lingua|huggingface] [--section.key value ...]
  canon-titan convert from-hf HF_DIR OUT_DIR --config FILE.toml [--section.key value ...]
  canon-titan data tokenize --input GLOB [--input GLOB ...] --out DIR --tokenizer PATH [--tokenizer-kind hf|sentencepiece|tiktoken] [--workers N]
  canon-titan data inspect DIR [--samples N]
  canon-titan data capo-people --config FILE.toml --out FILE.jsonl [--section.key value ...]
  canon-titan data synthetic TASK --n N --out FILE.jsonl [--test] [--config FILE.toml] [--seed S] [--section.key value ...]
  canon-titan data multihop --background FILE (--out FILE.jsonl | --out-dir DIR) [--hops 1|2] [--people N] [--context-tokens M] [--count N] [--seed S] [--tokenizer PATH --tokenizer-kind KIND]
  canon-titan eval synthetic --config FILE.toml [--checkpoint DIR] [--count N] [--seed S] [--out FILE.json] [--section.key value ...]
  canon-titan eval lm --model HF_DIR|CKPT_DIR --suite avg10|all13|TASK ... [--dtype bf16|fp32] [--limit N] [--data-dir DIR] [--out FILE.json]
  canon-titan report RUN_DIR [RUN_DIR ...] --out FILE.png [--html FILE.html] [--labels A,B,...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


OVERRIDES = ("Any further --section.key value argument overrides that key of the TOML, e.g. --training.steps 10 "
             "or --model.flavor 1B (values are TOML literals; a bare --section.flag means true).")
BUILTIN_TOKENIZER = Path(__file__).resolve().parent / "assets" / "builtin"


def _load_or_report(path: str, overrides: list[str], environment: bool = True):
    """The resolved run, after our checks and TorchTitan's own (building its Trainer.Config), or the error."""
    from canon_titan.config import ConfigError, build_trainer_config, load

    try:
        run = load(path, overrides, environment)
        build_trainer_config(run)
        return run, None
    except ConfigError as e:
        return None, str(e)


def cmd_train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="canon-titan train", description="Single-node training launch (torchrun --standalone).", epilog=OVERRIDES)
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs, or CPU ranks) on this node")
    parser.add_argument("--log-ranks", help="ranks whose output is shown (torchrun --local-ranks-filter; default: "
                        "rank 0, or with pipeline parallelism the first rank of the last stage, which has the loss)")
    args, overrides = parser.parse_known_args(argv)  # --section.key overrides pass through
    if args.nproc < 1:
        parser.error("--nproc must be >= 1")
    os.environ["WORLD_SIZE"] = str(args.nproc)
    run, error = _load_or_report(args.config, overrides)
    del os.environ["WORLD_SIZE"]
    if error:
        print(f"canon-titan: config error: {error}", file=sys.stderr)
        return 2
    error = _prepare_launch(run)
    if error:
        print(f"canon-titan: {error}", file=sys.stderr)
        return 2
    log_ranks = args.log_ranks
    if log_ranks is None:
        pp = run["parallelism"]["pipeline_parallel_degree"]
        log_ranks = str((pp - 1) * args.nproc // pp)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "--local-ranks-filter", log_ranks, "--role", "rank", "--tee", "3",
           "-m", "canon_titan.train", "--config", args.config, *overrides]
    print("+ " + " ".join(cmd), flush=True)
    from canon_titan.launch import torchrun_preexec

    env = dict(os.environ, CANON_TITAN_COLOR="1" if sys.stdout.isatty() else "0")
    # Share the cores between the processes (torchrun would default to 1 and print a banner saying so).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    return subprocess.call(cmd, preexec_fn=torchrun_preexec, env=env)


def _prepare_launch(run) -> str | None:
    """What the workers would stop on before training, checked before torchrun starts: TorchTitan's
    own config checks, a live run in the dump folder, no loadable checkpoint to resume from. Prints
    the checkpoints that will be skipped. Returns the error, or None."""
    from canon_titan.config import dumps
    from canon_titan.config.build import absolute_paths
    from canon_titan.convert.dcp_io import NoLoadableCheckpoint, resume_step
    from canon_titan.launch import DumpFolderInUse, lock_dump_folder
    from canon_titan.trainer import RUN_CONFIG_FILE, config_changes, finished_message

    dump = run["job"]["dump_folder"]
    try:
        lock_dump_folder(dump, hold=False)
        if run["checkpoint"]["enable"]:
            step, skipped = resume_step(Path(dump) / run["checkpoint"]["folder"], run["checkpoint"]["load_step"])
            for message in skipped:
                print(f"canon-titan: warning: {message}", file=sys.stderr)
            if step >= run["training"]["steps"]:
                return finished_message(dump, step, run["training"]["steps"])
    except (DumpFolderInUse, NoLoadableCheckpoint) as e:
        return str(e)
    changes = config_changes(os.path.join(dump, RUN_CONFIG_FILE), dumps(absolute_paths(run.sections)))
    if changes:
        print(f"canon-titan: warning: the config differs from the one of the run already in {dump}: {changes}",
              file=sys.stderr)
    return None


def cmd_config(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="canon-titan config")
    sub = parser.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the resolved config (defaults and overrides applied) as TOML",
                          epilog=OVERRIDES)
    show.add_argument("file")
    show.add_argument("--static", action="store_true", help="do not check data paths, tokenizer files or hardware")
    validate = sub.add_parser("validate", help="check config files; exit status 2 if any is invalid",
                              epilog=OVERRIDES + " They apply to every file.")
    validate.add_argument("files", nargs="+")
    validate.add_argument("--world-size", type=int, help="also check the parallelism degrees against N ranks")
    validate.add_argument("--static", action="store_true",
                          help="do not check data paths, tokenizer files or hardware (--world-size still applies)")
    # Overrides start with "--section.": keep them away from argparse's positional matching.
    split = next((i for i, a in enumerate(argv) if a.startswith("--") and "." in a.split("=")[0]), len(argv))
    args, unknown = parser.parse_known_args(argv[:split])
    overrides = unknown + argv[split:]

    from canon_titan.config import dumps

    if args.action == "show":
        run, error = _load_or_report(args.file, overrides, not args.static)
        if error:
            print(f"canon-titan: config error: {error}", file=sys.stderr)
            return 2
        print(f"# resolved from {args.file}" + (f" with {' '.join(overrides)}" if overrides else ""))
        print(dumps(run.sections), end="")
        return 0

    if args.world_size is not None:
        if args.world_size < 1:
            print(f"canon-titan: config error: --world-size must be >= 1, got {args.world_size}", file=sys.stderr)
            return 2
        os.environ["WORLD_SIZE"] = str(args.world_size)
    failed = 0
    for path in args.files:
        run, error = _load_or_report(path, overrides, not args.static)
        if error:
            failed += 1
            print(f"INVALID {error}", file=sys.stderr)
        else:
            print(f"ok      {path} ({run['model']['name']} {run['model']['flavor']})")
    return 2 if failed else 0


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def cmd_convert(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="canon-titan convert")
    sub = parser.add_subparsers(dest="direction", required=True)
    to_hf = sub.add_parser("to-hf", help="DCP checkpoint (any parallel layout) -> Hugging Face folder",
                           epilog=OVERRIDES)
    to_hf.add_argument("ckpt_dir", help="a step-N folder, or a checkpoint folder (its newest step is used)")
    to_hf.add_argument("out_dir", help="must not exist (or be empty); written atomically")
    to_hf.add_argument("--config", required=True,
                       help="the TOML the checkpoint was trained with, e.g. its {dump_folder}/run_config.toml")
    to_hf.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    to_hf.add_argument("--rope-layout", choices=["lingua", "huggingface"], default="lingua",
                       help="LlamaCanon exports: keep interleaved RoPE pairs (lingua) or permute q/k to rotate-half")
    to_hf.add_argument("--max-shard-size", type=_size, default="5GB", help="e.g. 2GB, 500MB")
    from_hf = sub.add_parser("from-hf", help="Hugging Face folder -> DCP folder for [checkpoint] initial_load_path",
                             epilog=OVERRIDES)
    from_hf.add_argument("hf_dir")
    from_hf.add_argument("out_dir")
    from_hf.add_argument("--config", required=True, help="the TOML of the run that will load the weights")
    args, overrides = parser.parse_known_args(argv)

    from torchtitan.tools.logging import init_logger

    from canon_titan.config import ConfigError, load
    from canon_titan.convert.dcp_io import ConversionError
    from canon_titan.convert.hf import from_hf as run_from_hf, to_hf as run_to_hf

    init_logger()
    try:
        run = load(args.config, overrides, environment=False)
        if args.direction == "to-hf":
            run_to_hf(args.ckpt_dir, args.out_dir, run, dtype=args.dtype, rope_layout=args.rope_layout,
                      max_shard_size=args.max_shard_size)
        else:
            run_from_hf(args.hf_dir, args.out_dir, run)
    except ConfigError as e:
        print(f"canon-titan: config error: {e}", file=sys.stderr)
        return 2
    except ConversionError as e:
        print(f"canon-titan: conversion error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, permissions: the message names the file
        print(f"canon-titan: conversion error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_data(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="canon-titan data")
    sub = parser.add_subparsers(dest="action", required=True)
    tok = sub.add_parser("tokenize", help="document files -> memory-mappable token shards (resumable)")
    tok.add_argument("--input", action="append", required=True, help="glob of .jsonl/.json/.zst/.parquet files")
    tok.add_argument("--out", required=True)
    tok.add_argument("--tokenizer", required=True,
                     help=f"tokenizer file or folder (the built-in one, kind hf, is {BUILTIN_TOKENIZER})")
    tok.add_argument("--tokenizer-kind", choices=["hf", "sentencepiece", "tiktoken"], default="hf")
    tok.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    tok.add_argument("--text-key", default="text")
    tok.add_argument("--on-error", choices=["fail", "skip"], default="fail")
    inspect = sub.add_parser("inspect", help="token counts per shard, problems, and decoded samples; exit 2 if a "
                             "shard is missing, has the wrong size or ids outside the vocabulary")
    inspect.add_argument("folder")
    inspect.add_argument("--samples", type=int, default=2)
    inspect.add_argument("--max-chars", type=int, default=400)
    inspect.add_argument("--verify", action="store_true",
                         help="also read every shard: recorded checksums and the largest id actually stored")
    people = sub.add_parser("capo-people", epilog=OVERRIDES, help="the Capo population of a config as JSON lines, with a "
                            "prompt per person for writing bioR biographies")
    people.add_argument("--config", required=True, help="a TOML with [dataloader] dataset = 'capo_bios'")
    people.add_argument("--out", required=True)
    syn = sub.add_parser("synthetic", epilog=OVERRIDES, help="samples of a synthetic task as JSON lines: the training samples the "
                         "dataloader draws (token ids, answer and loss masks), or the held-out test items")
    syn.add_argument("task", help="depo1, depo2, brevo1, brevo2, mano, lano or capo_bios")
    syn.add_argument("--n", type=int, required=True, help="training samples, or test items per group with --test")
    syn.add_argument("--out", required=True)
    syn.add_argument("--test", action="store_true", help="the held-out test items that eval synthetic scores")
    syn.add_argument("--config", help="a run's TOML whose task section, tokenizer, seq_len and seeds apply "
                     "(default: the built-in debug config with seq_len 2048, room for every preset)")
    syn.add_argument("--seed", type=int, help="[dataloader] seed for training samples (default: the config's), or "
                     "the test set's seed with --test (default: eval synthetic's)")
    hop = sub.add_parser("multihop", help="multi-hop birth-year test file: people's birth years scattered in "
                         "background text (JSON lines: prompt, answer)")
    hop.add_argument("--background", required=True, help="plain text, or documents (.jsonl/.zst/.parquet) with --text-key")
    hop.add_argument("--text-key", default="text", help="document field holding the text (reference Wikipedia: plaintext)")
    where = hop.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="one test file, for --hops/--context-tokens")
    where.add_argument("--out-dir", help="the reference grid for the eval/ tasks: OUT_DIR/multihop/{1hop,2hop}_"
                       "{0k,0.5k,1k,2k,3k,4k,5k,6k}.jsonl (1-hop N=5, 2-hop N=3; k = 1024 tokens)")
    hop.add_argument("--hops", type=int, default=1, help="k: 1 (people per group 5 by default) or 2 (3)")
    hop.add_argument("--people", type=int, help="n, people per group (default 5 for 1 hop, 3 otherwise)")
    hop.add_argument("--context-tokens", type=int, default=0, help="M: background tokens stay below this")
    hop.add_argument("--count", type=int, default=200)
    hop.add_argument("--seed", type=int, default=42)
    hop.add_argument("--tokenizer", help="tokenizer counting M (default: the built-in one)")
    hop.add_argument("--tokenizer-kind", choices=["hf", "sentencepiece", "tiktoken"], default="hf")
    args, overrides = parser.parse_known_args(argv)
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

    from canon_titan.data.documents import DataError
    from canon_titan.data.pretokenize import tokenize_files

    try:
        if args.action == "tokenize":
            index = tokenize_files(args.input, args.out, kind=args.tokenizer_kind, tokenizer_path=args.tokenizer,
                                   workers=args.workers, text_key=args.text_key, on_error=args.on_error)
            skipped = sum(s["skipped"] for s in index["shards"])
            print(f"[tokenize] done: {sum(s['tokens'] for s in index['shards']):,} tokens in "
                  f"{len(index['shards'])} shards at {args.out}" + (f"; skipped {skipped} bad records" if skipped else ""))
            return 0
        return _inspect_tokens(args)
    except (DataError, FileNotFoundError) as e:
        print(f"canon-titan: data error: {e}", file=sys.stderr)
        return 2


def _inspect_tokens(args) -> int:
    import numpy as np

    from canon_titan.data.pretokenize import open_shards, read_index, shard_problem
    from canon_titan.data.tokenizers import build_tokenizer

    index = read_index(args.folder)
    tok_info, dtype = index["tokenizer"], np.dtype(index["dtype"])
    vocab = tok_info["vocab_size"]
    print(f"{args.folder}: tokenizer {tok_info['kind']} {tok_info['path']} ({vocab} ids), dtype {dtype}")
    print(f"{'shard':<12} {'tokens':>14} {'documents':>10} {'skipped':>8}  source")
    problems = []
    for shard in index["shards"]:
        print(f"{shard['shard']:<12} {shard['tokens']:>14,} {shard['documents']:>10,} {shard['skipped']:>8}  "
              f"{shard['source']}")
        path = Path(args.folder) / shard["shard"]
        problem = shard_problem(path, shard, dtype.itemsize, checksum=args.verify, vocab_size=vocab)
        if problem:
            problems.append(problem)
        if args.verify and shard["tokens"] and path.is_file() and path.stat().st_size == shard["tokens"] * dtype.itemsize:
            stored = np.memmap(path, dtype=dtype, mode="r")
            outside = int((stored >= vocab).sum())
            if outside:
                problems.append(f"{path} holds {outside} token ids outside the vocabulary of {vocab} "
                                f"(largest {int(stored.max())})")
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
            text = tokenizer.decode([t for t in doc if t not in (tok_info["bos_id"], tok_info["eos_id"])])
            print(f"--- document {i} ({len(doc)} tokens)\n{text[: args.max_chars]}")
    return 2 if problems else 0


def _multihop(args) -> int:
    import json

    from canon_titan.data.builtin import ASSET_DIR
    from canon_titan.data.tokenizers import build_tokenizer
    from canon_titan.evaluation import multihop
    from canon_titan.fileio import write_atomic

    if args.hops < 1 or args.count < 1 or args.context_tokens < 0:
        print("canon-titan: data error: --hops and --count must be >= 1, --context-tokens >= 0", file=sys.stderr)
        return 2
    if args.out_dir:
        from canon_titan.evaluation.lm_tasks import MULTIHOP_CONTEXTS, MULTIHOP_HOPS

        jobs = [(Path(args.out_dir) / "multihop" / f"{hops}_{label}.jsonl", n, k, tokens)
                for hops, (n, k) in MULTIHOP_HOPS.items() for label, tokens in MULTIHOP_CONTEXTS.items()]
    else:
        jobs = [(Path(args.out), args.people or (5 if args.hops == 1 else 3), args.hops, args.context_tokens)]
    try:
        tokenizer = build_tokenizer(args.tokenizer_kind, args.tokenizer or str(ASSET_DIR))
        background = multihop.read_background(args.background, args.text_key)
        for out, n, k, tokens in jobs:
            records = multihop.generate(n, k, tokens, args.count, args.seed, background,
                                        lambda text: len(tokenizer.encode(text, add_bos=False, add_eos=False)))
            out.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(out, "".join(json.dumps(r) + "\n" for r in records))
            print(f"[multihop] {len(records)} prompts ({k}-hop, N={n}, < {tokens} background tokens) -> {out}")
    except (OSError, ValueError) as e:
        print(f"canon-titan: data error: {e}", file=sys.stderr)
        return 2
    return 0


def _synthetic_samples(args, overrides: list[str]) -> int:
    import json

    from canon_titan.config import ConfigError, load
    from canon_titan.data.packed import DataConfigError
    from canon_titan.fileio import write_atomic

    if args.n < 1:
        print("canon-titan: data error: --n must be >= 1", file=sys.stderr)
        return 2
    config = args.config or str(Path(__file__).resolve().parent.parent / "train_configs" / "llama_debug.toml")
    base = [] if args.config else ["--training.seq_len", "2048"]
    seed = [] if args.seed is None or args.test else ["--dataloader.seed", str(args.seed)]
    try:
        run = load(config, [*base, "--dataloader.dataset", args.task, *seed, *overrides])
    except ConfigError as e:
        print(f"canon-titan: config error: {e}", file=sys.stderr)
        return 2
    from canon_titan.data.synthetic import SyntheticDataLoader, loader_config
    from canon_titan.synthetic_eval import DEFAULT_TEST_SEED

    lines = []
    try:
        loader = SyntheticDataLoader(loader_config(run), dp_world_size=1, dp_rank=0, tokenizer=run_tokenizer(run),
                                     seq_len=run["training"]["seq_len"], local_batch_size=1)
        if args.test:
            for item in loader.task.test_items(DEFAULT_TEST_SEED if args.seed is None else args.seed, args.n):
                lines.append({"group": item.group, "prompt": item.prompt, "answer": item.answer})
        else:
            for window, sample, tokens, flags in loader.samples():
                record = {"sample": list(sample), "window": window, "tokens": tokens, "loss_mask": flags}
                generated = loader.task.train_sample(loader.stream(sample))
                if hasattr(generated, "labels"):
                    record["answer_mask"] = generated.labels
                else:
                    record["text"] = generated
                lines.append(record)
                if len(lines) == args.n:
                    break
    except DataConfigError as e:
        print(f"canon-titan: data error: {e}", file=sys.stderr)
        return 2
    write_atomic(args.out, "".join(json.dumps(line) + "\n" for line in lines))
    what = "test items" if args.test else "training samples (in the order the dataloader trains on them)"
    print(f"[synthetic] {len(lines)} {args.task} {what} ({loader.task.params}) -> {args.out}")
    return 0


def run_tokenizer(run):
    from canon_titan.data.builtin import ASSET_DIR
    from canon_titan.data.tokenizers import build_tokenizer

    return build_tokenizer(run["tokenizer"]["kind"], run["tokenizer"]["path"] or str(ASSET_DIR))


def _capo_people(args, overrides: list[str]) -> int:
    import dataclasses
    import json
    import random

    from canon_titan.config import ConfigError, load
    from canon_titan.fileio import write_atomic
    from synthetic_data import capo

    try:
        run = load(args.config, overrides, environment=False)
    except ConfigError as e:
        print(f"canon-titan: config error: {e}", file=sys.stderr)
        return 2
    if run["dataloader"]["dataset"] != "capo_bios":
        print(f"canon-titan: config error: {args.config}: [dataloader] dataset must be 'capo_bios', "
              f"not {run['dataloader']['dataset']!r}", file=sys.stderr)
        return 2
    params = capo.CapoParams(**{k: v for k, v in run["capo"].items() if v is not None})
    rng = random.Random(f"bior-prompts/{params.population_seed}")
    lines = [json.dumps({**dataclasses.asdict(p), "name": p.name, "pronoun": p.pronoun,
                         "prompt": capo.bior_prompt(p, rng)}) for p in capo.population(params)]
    write_atomic(args.out, "\n".join(lines) + "\n")
    print(f"[capo] {len(lines)} people -> {args.out}; write bioR lines as {{\"id\": ..., \"text\": ...}} "
          "and set [capo] bior_path")
    return 0


def cmd_eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="canon-titan eval")
    sub = parser.add_subparsers(dest="kind", required=True)
    syn = sub.add_parser("synthetic", help="greedy accuracy on a synthetic task's held-out test set",
                         epilog=OVERRIDES)
    syn.add_argument("--config", required=True,
                     help="the run's TOML (or its {dump_folder}/run_config.toml): model and [dataloader] task")
    syn.add_argument("--checkpoint", help="a step-N folder or a checkpoint folder (newest step); "
                     "default: {dump_folder}/checkpoint of the config")
    syn.add_argument("--count", type=int, default=100, help="test items per group (Brevo: 4x this many graphs)")
    syn.add_argument("--seed", type=int, help="test-set seed (default: the fixed held-out one)")
    syn.add_argument("--out", help="JSON results (default: {dump_folder}/eval_synthetic.json)")
    lm = sub.add_parser("lm", help="lm-eval tasks and suites on an HF export or a DCP checkpoint (no BOS added)")
    lm.add_argument("--model", required=True, help="an HF export folder (convert to-hf) or a DCP checkpoint "
                    "folder (step-N, or the checkpoint folder: newest step), converted in memory")
    lm.add_argument("--config", help="DCP only: the run's TOML (default: the run_config.toml the run wrote)")
    lm.add_argument("--suite", nargs="+", required=True, metavar="NAME",
                    help="avg10, all13 (the reference suites), or any lm-eval task/group, incl. those in eval/ "
                    "(multihop_1hop, multihop_2hop, babilong_avg20, ...)")
    lm.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default="bf16")
    lm.add_argument("--limit", type=float, help="items per task (a fraction if < 1), for quick checks")
    lm.add_argument("--batch-size", type=int, default=1)
    lm.add_argument("--data-dir", help="folder of the local test files of eval/ tasks (default $CANON_EVAL_DATA "
                    "or ./eval_data)")
    lm.add_argument("--include-path", action="append", default=[], help="another folder of lm-eval task YAMLs")
    lm.add_argument("--device", help="torch device (default: cuda when there is a GPU, else cpu)")
    lm.add_argument("--out", help="JSON results (default: eval_lm_<model folder>.json beside the model folder)")
    args, overrides = parser.parse_known_args(argv)
    if args.kind == "lm":
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        return _eval_lm(args)
    if args.count < 1:
        parser.error("--count must be >= 1")

    from torchtitan.tools.logging import init_logger

    from canon_titan.config import ConfigError, load
    from canon_titan.convert.dcp_io import ConversionError
    from canon_titan.synthetic_eval import DEFAULT_TEST_SEED, EvalError, evaluate, format_table, write_result

    init_logger()
    try:
        run = load(args.config, overrides, environment=False)
        checkpoint = args.checkpoint or os.path.join(run["job"]["dump_folder"], run["checkpoint"]["folder"])
        result = evaluate(run, checkpoint, count=args.count,
                          seed=DEFAULT_TEST_SEED if args.seed is None else args.seed)
    except ConfigError as e:
        print(f"canon-titan: config error: {e}", file=sys.stderr)
        return 2
    except (ConversionError, EvalError) as e:
        print(f"canon-titan: eval error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    out = args.out or os.path.join(run["job"]["dump_folder"], "eval_synthetic.json")
    write_result(result, out)
    print(f"[eval] wrote {out}")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _eval_lm(args) -> int:
    from torchtitan.tools.logging import init_logger

    from canon_titan.config import ConfigError
    from canon_titan.convert.dcp_io import ConversionError
    from canon_titan.evaluation import lm

    import torch

    init_logger()
    device = args.device or ("cuda" if _cuda() else "cpu")
    try:
        if torch.device(device).type == "cuda" and not _cuda():
            print(f"canon-titan: eval error: --device {device}: this machine has no CUDA device; use --device cpu",
                  file=sys.stderr)
            return 2
    except RuntimeError as e:
        print(f"canon-titan: eval error: --device {device}: {e}", file=sys.stderr)
        return 2
    try:
        lm.require_lm_eval()
        model, tokenizer, max_length = lm.load_for_eval(args.model, args.dtype, args.config)
        result = lm.evaluate(model.to(device), tokenizer, args.suite, max_length=max_length, limit=args.limit,
                             batch_size=args.batch_size, data_dir=args.data_dir, include_paths=args.include_path)
    except ConfigError as e:
        print(f"canon-titan: config error: {e}", file=sys.stderr)
        return 2
    except (ConversionError, lm.LMEvalError, FileNotFoundError) as e:
        print(f"canon-titan: eval error: {e}", file=sys.stderr)
        return 2
    record = lm.evaluation_record(result, model=args.model, dtype=args.dtype, limit=args.limit, tasks=args.suite)
    print(lm.lm_eval_tables(result))
    reference = lm.table(result)[1]
    if reference:
        print(f"reference columns (%):\n{reference}")
    out = args.out or lm.default_output(args.model)
    lm.write_json(record, out)
    print(f"[eval] wrote {out}")
    return 0


def cmd_report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="canon-titan report",
                                     description="loss and eval metrics vs tokens for several runs side by side")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="dump folders of training runs")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--html", help="also a self-contained HTML page (figure inline, last values)")
    parser.add_argument("--labels", help="comma-separated names, one per run (default: [job] description or folder)")
    parser.add_argument("--smooth", type=float, default=0.0, help="EMA factor for the loss curve, 0 <= s < 1")
    args = parser.parse_args(argv)
    if not 0 <= args.smooth < 1:
        parser.error("--smooth must be in [0, 1)")

    from canon_titan.report import ReportError, write_report

    try:
        runs = write_report(args.runs, args.out, args.html, args.labels.split(",") if args.labels else None,
                            args.smooth)
    except ReportError as e:
        print(f"canon-titan: report error: {e}", file=sys.stderr)
        return 2
    print(f"[report] {len(runs)} runs -> {args.out}" + (f" and {args.html}" if args.html else ""))
    return 0


COMMANDS = {"train": cmd_train, "config": cmd_config, "convert": cmd_convert, "data": cmd_data, "eval": cmd_eval,
            "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\ncanon-titan: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        return 0
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
