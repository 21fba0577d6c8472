"""What the commands share: the override epilog, the built-in tokenizer, ``--dtype`` and override
parsing, and error lines. Light: ``config validate`` imports no trainer or model code."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from canon_titan.config.loader import DTYPE_SPELLINGS

OVERRIDES = (
    "Any further --section.key value argument overrides that key of the TOML, e.g. "
    "--training.steps 10 "
    "or --model.flavor 1B (values are TOML literals; a bare --section.flag means true); "
    "--section.key unset drops a key the TOML sets, which then takes its default "
    "(the flavor's, in [model])."
)
BUILTIN_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "builtin"


def dtype_arg(text: str) -> str:
    """A ``--dtype`` value as its short name, whichever spelling was typed."""
    short = {long: short for short, long in DTYPE_SPELLINGS.items()}.get(text, text)
    if short not in DTYPE_SPELLINGS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dtype; one of "
            + ", ".join(f"{s} ({long})" for s, long in DTYPE_SPELLINGS.items())
        )
    return short


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str]):
    """``parser.parse_known_args(argv)``, where what is left must be ``--section.key`` overrides: an
    option of another spelling (``--gpus_per_node``, ``--nprocs``) is an error that names the option
    meant, not a malformed override."""
    args, rest = parser.parse_known_args(argv)
    options = sorted(
        {
            o
            for p in _parsers(parser)
            for a in p._actions
            for o in a.option_strings
            if o.startswith("--")
        }
    )
    for arg in rest:
        name = arg.split("=")[0]
        if name.startswith("--") and "." not in name:
            same = [o for o in options if o.replace("_", "-") == name.replace("_", "-")]
            close = same or difflib.get_close_matches(name, options, n=1, cutoff=0.75)
            parser.error(
                f"unknown option {name}"
                + (f"; did you mean {close[0]}?" if close else f"; options: {', '.join(options)}")
            )
    return args, rest


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def fail(kind: str, message) -> int:
    """Print ``canon-titan: KIND error: message`` to stderr; the exit status of a failed command."""
    print(f"canon-titan: {kind} error: {message}", file=sys.stderr)
    return 2
