"""``canon-titan eval synthetic|lm``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from canon_titan.cli.common import OVERRIDES, dtype_arg, fail, parse_with_overrides
from canon_titan.config import ConfigError, load
from canon_titan.convert.dcp_io import ConversionError
from canon_titan.convert.hf import dcp_to_hf_model
from canon_titan.data.builtin import ASSET_DIR
from canon_titan.evaluation import lm
from canon_titan.evaluation.synthetic import (
    DEFAULT_TEST_SEED,
    EvalError,
    evaluate,
    format_table,
    write_result,
)
from canon_titan.tools.startup import init_logging
from canon_titan.trainer import RUN_CONFIG_FILE


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="canon-titan eval")
    sub = parser.add_subparsers(dest="kind", required=True)
    syn = sub.add_parser(
        "synthetic",
        help="greedy accuracy on a synthetic task's held-out test set",
        epilog=OVERRIDES,
    )
    syn.add_argument(
        "--config",
        required=True,
        help="the run's TOML (or its {dump_folder}/run_config.toml): model and [dataloader] task",
    )
    syn.add_argument(
        "--checkpoint",
        help="a step-N folder or a checkpoint folder (newest step); "
        "default: {dump_folder}/checkpoint of the config",
    )
    syn.add_argument(
        "--count", type=int, default=100, help="test items per group (Brevo: 4x this many graphs)"
    )
    syn.add_argument("--seed", type=int, help="test-set seed (default: the fixed held-out one)")
    syn.add_argument("--out", help="JSON results (default: {dump_folder}/eval_synthetic.json)")
    lm_parser = sub.add_parser(
        "lm", help="lm-eval tasks and suites on an HF export or a DCP checkpoint (no BOS added)"
    )
    lm_parser.add_argument(
        "--model",
        required=True,
        help="an HF export folder (convert to-hf) or a DCP checkpoint "
        "folder (step-N, or the checkpoint folder: newest step), converted in memory",
    )
    lm_parser.add_argument(
        "--config", help="DCP only: the run's TOML (default: the run_config.toml the run wrote)"
    )
    lm_parser.add_argument(
        "--suite",
        nargs="+",
        required=True,
        metavar="NAME",
        help="avg10, all13 (the reference suites), or any lm-eval task/group, incl. those in "
        "eval/ (multihop_1hop, multihop_2hop, babilong_avg20, ...)",
    )
    lm_parser.add_argument(
        "--dtype",
        type=dtype_arg,
        default="bf16",
        help="bf16, fp32 or fp16 (or bfloat16, float32, float16)",
    )
    lm_parser.add_argument(
        "--limit", type=float, help="items per task (a fraction if < 1), for quick checks"
    )
    lm_parser.add_argument("--batch-size", type=int, default=1)
    lm_parser.add_argument(
        "--max-length",
        type=int,
        metavar="TOKENS",
        help="tokens the model reads of each input, prompt and answer together (default: "
        f"{lm.LENGTH_FACTOR}x the model's training length, as the release evaluates its "
        "4096-token models at 8192); lm-eval keeps the last ones of a longer input, and the "
        "evaluation says so per task",
    )
    lm_parser.add_argument(
        "--data-dir",
        help="folder of the local test files of eval/ tasks (default "
        "$CANON_EVAL_DATA or ./eval_data)",
    )
    lm_parser.add_argument(
        "--include-path", action="append", default=[], help="another folder of lm-eval task YAMLs"
    )
    lm_parser.add_argument(
        "--device", help="torch device (default: cuda when there is a GPU, else cpu)"
    )
    lm_parser.add_argument(
        "--out", help="JSON results (default: eval_lm_<model folder>.json beside the model folder)"
    )
    args, overrides = parse_with_overrides(parser, argv)
    if args.kind == "lm":
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        if args.max_length is not None and args.max_length < 2:
            parser.error(f"--max-length must be >= 2 tokens, got {args.max_length}")
        return _eval_lm(args)
    if args.count < 1:
        parser.error("--count must be >= 1")

    init_logging()
    try:
        run = load(args.config, overrides, environment=False)
        checkpoint = args.checkpoint or os.path.join(
            run["job"]["dump_folder"], run["checkpoint"]["folder"]
        )
        result = evaluate(
            run,
            checkpoint,
            count=args.count,
            seed=DEFAULT_TEST_SEED if args.seed is None else args.seed,
        )
    except ConfigError as e:
        return fail("config", e)
    except (ConversionError, EvalError) as e:
        return fail("eval", e)
    print(format_table(result))
    out = args.out or os.path.join(run["job"]["dump_folder"], "eval_synthetic.json")
    write_result(result, out)
    print(f"[eval] wrote {out}")
    return 0


def run_config_near(checkpoint: Path) -> Path:
    """The ``run_config.toml`` a training run wrote, found from one of its checkpoint folders."""
    for folder in [checkpoint, *checkpoint.parents][:4]:
        if (folder / RUN_CONFIG_FILE).is_file():
            return folder / RUN_CONFIG_FILE
    raise ConversionError(
        f"{checkpoint}: no {RUN_CONFIG_FILE} in it or the three folders above it; "
        "pass the run's TOML with --config"
    )


def _model_for_eval(model: Path, dtype: str, config: str | None):
    """(transformers model, tokenizer, training length) from an HF export, or a DCP checkpoint
    converted in memory."""
    if (model / "config.json").is_file():
        return lm.load_hf_folder(model, dtype)
    if not model.is_dir():
        raise ConversionError(
            f"--model {model}: no such folder (an HF export or a DCP checkpoint folder)"
        )
    run = load(config or run_config_near(model), environment=False)
    tok = lm.hf_tokenizer(run["tokenizer"]["kind"], run["tokenizer"]["path"] or str(ASSET_DIR))
    return dcp_to_hf_model(model, run, dtype), tok, run["training"]["seq_len"]


def _eval_lm(args) -> int:
    init_logging()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            return fail(
                "eval", f"--device {device}: this machine has no CUDA device; use --device cpu"
            )
    except RuntimeError as e:
        return fail("eval", f"--device {device}: {e}")
    try:
        lm.require_lm_eval()
        model, tokenizer, trained_at = _model_for_eval(Path(args.model), args.dtype, args.config)
        max_length = args.max_length or lm.default_max_length(trained_at)
        result = lm.evaluate(
            model.to(device),
            tokenizer,
            args.suite,
            max_length=max_length,
            limit=args.limit,
            batch_size=args.batch_size,
            data_dir=args.data_dir,
            include_paths=args.include_path,
        )
    except ConfigError as e:
        return fail("config", e)
    except (ConversionError, lm.LMEvalError, FileNotFoundError) as e:
        return fail("eval", e)
    record = lm.evaluation_record(
        result,
        model=args.model,
        dtype=args.dtype,
        limit=args.limit,
        tasks=args.suite,
        training_length=trained_at,
    )
    print(lm.lm_eval_tables(result))
    if result["truncated"]:
        print(
            f"[eval] {len(result['truncated'])} task(s) had inputs longer than max_length "
            f"{max_length:,} "
            f"(the model trained at {trained_at:,}): their scores are of the inputs' last tokens; "
            "--max-length reads more"
        )
    reference = lm.table(result)[1]
    if reference:
        print(f"reference columns (%):\n{reference}")
    out = args.out or lm.default_output(args.model)
    lm.write_json(record, out)
    print(f"[eval] wrote {out}")
    return 0
