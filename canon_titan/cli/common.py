"""What the commands share: the override epilog, the built-in tokenizer, loading a run config
with every check (ours and TorchTitan's), and error lines. Light: ``config validate`` imports no
trainer or model code."""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from pathlib import Path

from torchtitan.tools.logging import init_logger

from canon_titan.config import ConfigError, load
from canon_titan.config.loader import DTYPE_SPELLINGS
from canon_titan.config.titan_sections import titan_sections

OVERRIDES = ("Any further --section.key value argument overrides that key of the TOML, e.g. --training.steps 10 "
             "or --model.flavor 1B (values are TOML literals; a bare --section.flag means true); "
             "--section.key unset drops a key the TOML sets, which then takes its default "
             "(the flavor's, in [model]).")
BUILTIN_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "builtin"


def dtype_arg(text: str) -> str:
    """A ``--dtype`` value as its short name, whichever spelling was typed."""
    short = {long: short for short, long in DTYPE_SPELLINGS.items()}.get(text, text)
    if short not in DTYPE_SPELLINGS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a dtype; one of "
                                         + ", ".join(f"{s} ({long})" for s, long in DTYPE_SPELLINGS.items()))
    return short


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str]):
    """``parser.parse_known_args(argv)``, where what is left must be ``--section.key`` overrides: an
    option of another spelling (``--gpus_per_node``, ``--nprocs``) is an error that names the option
    meant, not a malformed override."""
    args, rest = parser.parse_known_args(argv)
    options = sorted({o for p in _parsers(parser) for a in p._actions for o in a.option_strings if o.startswith("--")})
    for arg in rest:
        name = arg.split("=")[0]
        if name.startswith("--") and "." not in name:
            same = [o for o in options if o.replace("_", "-") == name.replace("_", "-")]
            close = same or difflib.get_close_matches(name, options, n=1, cutoff=0.75)
            parser.error(f"unknown option {name}" + (f"; did you mean {close[0]}?" if close else
                                                     f"; options: {', '.join(options)}"))
    return args, rest


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def load_or_report(path: str, overrides: list[str], environment: bool = True, build=titan_sections):
    """The resolved run, after our checks and TorchTitan's own, or the error. ``build(run)`` makes
    TorchTitan's configs: of the sections (what ``config validate`` checks), or ``train``'s whole
    ``Trainer.Config`` with the model (``config.build.build_trainer_config``)."""
    try:
        run = load(path, overrides, environment)
        build(run)
        return run, None
    except ConfigError as e:
        return None, str(e)


def fail(kind: str, message) -> int:
    """Print ``canon-titan: KIND error: message`` to stderr; the exit status of a failed command."""
    print(f"canon-titan: {kind} error: {message}", file=sys.stderr)
    return 2


class _CurrentStdout:
    """``sys.stdout`` as it is when a record is written, not when logging was set up."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


def init_logging() -> None:
    """TorchTitan's log format on stdout. A command may run more than once in one process (a
    notebook, the tests) with stdout replaced in between; the handler writes to the current one."""
    init_logger()
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(_CurrentStdout())
