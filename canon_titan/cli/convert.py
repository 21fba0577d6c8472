"""``canon-titan convert to-hf|from-hf``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torchtitan.tools.logging import logger

from canon_titan.cli.common import OVERRIDES, dtype_arg, fail, parse_with_overrides
from canon_titan.config import ConfigError, RunConfig, load
from canon_titan.convert.dcp_io import ConversionError
from canon_titan.convert.hf import from_hf as run_from_hf
from canon_titan.convert.hf import to_hf as run_to_hf
from canon_titan.data.tokenizers import folder_tokenizer_kind
from canon_titan.tools.startup import init_logging


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _weights_vocab(hf_dir: Path) -> int | None:
    """``vocab_size`` of the folder's config.json (None when unreadable: ``from_hf`` says why)."""
    try:
        vocab = json.loads((hf_dir / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return vocab if isinstance(vocab, int) else None


def import_run(config: str, hf_dir: Path, overrides: list[str]) -> RunConfig:
    """The run that ``from-hf`` converts for. Conversion needs no tokenizer: the folder's own sets
    the vocabulary when it has one; otherwise the weights do, whatever the config's tokenizer
    has."""
    kind = folder_tokenizer_kind(hf_dir)
    if kind is not None:
        return load(
            config,
            ["--tokenizer.kind", kind, "--tokenizer.path", str(hf_dir), *overrides],
            environment=False,
        )
    vocab = _weights_vocab(hf_dir)
    run = load(config, overrides, environment=False, weights_vocab=vocab)
    if vocab is not None and run.tokenizer_vocab not in (None, vocab):
        logger.warning(
            f"{hf_dir} has no tokenizer: converting its weights with their vocabulary "
            f"({vocab} ids), "
            f"not the config's tokenizer's ({run.tokenizer_vocab}); a run training from "
            "them needs a "
            f"tokenizer of {vocab} ids ([tokenizer] path)"
        )
    return run


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="canon-titan convert")
    sub = parser.add_subparsers(dest="direction", required=True)
    to_hf = sub.add_parser(
        "to-hf",
        help="DCP checkpoint (any parallel layout) -> Hugging Face folder",
        epilog=OVERRIDES,
    )
    to_hf.add_argument(
        "ckpt_dir", help="a step-N folder, or a checkpoint folder (its newest step is used)"
    )
    to_hf.add_argument("out_dir", help="must not exist (or be empty); written atomically")
    to_hf.add_argument(
        "--config",
        required=True,
        help="the TOML the checkpoint was trained with, e.g. its {dump_folder}/run_config.toml",
    )
    to_hf.add_argument(
        "--dtype",
        type=dtype_arg,
        default="fp32",
        help="fp32, bf16 or fp16 (or float32, bfloat16, float16)",
    )
    to_hf.add_argument(
        "--rope-layout",
        choices=["lingua", "huggingface"],
        default="lingua",
        help="LlamaCanon exports: keep interleaved RoPE pairs (lingua) or permute q/k to "
        "rotate-half",
    )
    to_hf.add_argument("--max-shard-size", type=_size, default="5GB", help="e.g. 2GB, 500MB")
    from_hf = sub.add_parser(
        "from-hf",
        help="Hugging Face folder -> DCP folder for [checkpoint] initial_load_path",
        epilog=OVERRIDES,
    )
    from_hf.add_argument("hf_dir")
    from_hf.add_argument("out_dir")
    from_hf.add_argument(
        "--config",
        required=True,
        help="the TOML of the run that will load the weights (its "
        "model; the vocabulary comes from the folder's tokenizer, else from the weights)",
    )
    args, overrides = parse_with_overrides(parser, argv)

    init_logging()
    try:
        if args.direction == "to-hf":
            run = load(args.config, overrides, environment=False)
            run_to_hf(
                args.ckpt_dir,
                args.out_dir,
                run,
                dtype=args.dtype,
                rope_layout=args.rope_layout,
                max_shard_size=args.max_shard_size,
            )
        else:
            run_from_hf(
                args.hf_dir, args.out_dir, import_run(args.config, Path(args.hf_dir), overrides)
            )
    except ConfigError as e:
        return fail("config", e)
    except ConversionError as e:
        return fail("conversion", e)
    except OSError as e:  # disk full, permissions: the message names the file
        return fail("conversion", e)
    return 0
