"""``canon-titan config show|validate``."""

from __future__ import annotations

import argparse
import os
import sys

from canon_titan.cli.common import OVERRIDES, fail
from canon_titan.config import run_toml
from canon_titan.config.titan_sections import load_or_report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="canon-titan config")
    sub = parser.add_subparsers(dest="action", required=True)
    show = sub.add_parser(
        "show",
        epilog=OVERRIDES,
        help="print the resolved config (defaults and overrides applied) as "
        "TOML; [model] has the keys set, the flavor's shape as comments",
    )
    show.add_argument("file")
    show.add_argument(
        "--static", action="store_true", help="do not check data paths, tokenizer files or hardware"
    )
    validate = sub.add_parser(
        "validate",
        help="check config files; exit status 2 if any is invalid",
        epilog=OVERRIDES + " They apply to every file.",
    )
    validate.add_argument("files", nargs="+")
    validate.add_argument(
        "--world-size", type=int, help="also check the parallelism degrees against N ranks"
    )
    validate.add_argument(
        "--static",
        action="store_true",
        help="do not check data paths, tokenizer files or hardware (--world-size still applies)",
    )
    # Overrides start with "--section.": keep them away from argparse's positional matching.
    split = next(
        (i for i, a in enumerate(argv) if a.startswith("--") and "." in a.split("=")[0]), len(argv)
    )
    args, unknown = parser.parse_known_args(argv[:split])
    overrides = unknown + argv[split:]

    if args.action == "show":
        run, error = load_or_report(args.file, overrides, not args.static)
        if error and not args.static and load_or_report(args.file, overrides, False)[1] is None:
            error += (
                " (config show --static shows it without checking paths, tokenizer files or "
                "hardware)"
            )
        if error:
            return fail("config", error)
        print(
            f"# resolved from {args.file}" + (f" with {' '.join(overrides)}" if overrides else "")
        )
        print(run_toml(run), end="")
        return 0

    if args.world_size is not None:
        if args.world_size < 1:
            return fail("config", f"--world-size must be >= 1, got {args.world_size}")
        os.environ["WORLD_SIZE"] = str(args.world_size)
    failed = 0
    for path in args.files:
        run, error = load_or_report(path, overrides, not args.static)
        if error:
            failed += 1
            print(f"INVALID {error}", file=sys.stderr)
        else:
            print(f"ok      {path} ({run['model']['name']} {run['model']['flavor']})")
    return 2 if failed else 0
