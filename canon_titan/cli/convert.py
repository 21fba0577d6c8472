"""``canon-titan convert to-hf|from-hf``."""

from __future__ import annotations

import argparse

from canon_titan.cli.common import OVERRIDES, fail, init_logging
from canon_titan.config import ConfigError, load
from canon_titan.convert.dcp_io import ConversionError
from canon_titan.convert.hf import from_hf as run_from_hf, to_hf as run_to_hf


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def main(argv: list[str]) -> int:
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

    init_logging()
    try:
        run = load(args.config, overrides, environment=False)
        if args.direction == "to-hf":
            run_to_hf(args.ckpt_dir, args.out_dir, run, dtype=args.dtype, rope_layout=args.rope_layout,
                      max_shard_size=args.max_shard_size)
        else:
            run_from_hf(args.hf_dir, args.out_dir, run)
    except ConfigError as e:
        return fail("config", e)
    except ConversionError as e:
        return fail("conversion", e)
    except OSError as e:  # disk full, permissions: the message names the file
        return fail("conversion", e)
    return 0
