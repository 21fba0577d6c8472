"""The ``canon-titan`` command.

canon-titan train --config FILE.toml [--nproc N] [--section.key value ...]
canon-titan config show FILE.toml [--static] [--section.key value ...]
canon-titan config validate FILE.toml [FILE.toml ...] [--static] [--world-size N] [--section.key
value ...] canon-titan convert to-hf CKPT_DIR OUT_DIR --config FILE.toml [--dtype fp32|bf16|fp16]
[--rope-layout lingua|huggingface] [--section.key value ...] canon-titan convert from-hf HF_DIR
OUT_DIR --config FILE.toml [--section.key value ...] canon-titan data tokenize --input GLOB [--input
GLOB ...] --out DIR
    [--tokenizer PATH --tokenizer-kind hf|sentencepiece|tiktoken] [--workers N]
canon-titan data inspect DIR [--samples N]
canon-titan data capo-people --config FILE.toml --out FILE.jsonl [--section.key value ...]
canon-titan data synthetic TASK --n N --out FILE.jsonl [--test] [--config FILE.toml] [--seed S]
[--section.key value ...] canon-titan data multihop --background FILE (--out FILE.jsonl | --out-dir
DIR) [--hops 1|2] [--people N] [--context-tokens M] [--count N] [--seed S] [--tokenizer PATH
--tokenizer-kind KIND] canon-titan eval synthetic --config FILE.toml [--checkpoint DIR] [--count N]
[--seed S] [--out FILE.json] [--section.key value ...] canon-titan eval lm --model HF_DIR|CKPT_DIR
--suite avg10|all13|TASK ... [--dtype bf16|fp32] [--limit N] [--data-dir DIR] [--out FILE.json]
canon-titan plan FILE.toml --gpus N [--gpus-per-node 8] [--gpu h100|h200|a100|b200|FILE.toml]
[--json] [--section.key value ...] canon-titan report RUN_DIR [RUN_DIR ...] --out FILE.png [--html
FILE.html] [--labels A,B,...] canon-titan sweep SPEC.toml [--out DIR] [--jobs N] [--dry-run |
--slurm | --collect]
                  [--check WINNER>LOSER:GROUP:POINTS]
"""

from __future__ import annotations

import importlib
import signal
import sys

COMMANDS = {
    "train": "train",
    "config": "config",
    "plan": "plan",
    "convert": "convert",
    "data": "data",
    "eval": "evaluate",
    "report": "report",
    "sweep": "sweep",
}
"""Command -> its module in this package (each defines ``main(argv) -> exit status``)."""


def main(argv: list[str] | None = None) -> int:
    from canon_titan.tools.startup import process_setup

    process_setup()
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(
                f"\ncanon-titan: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}",
                file=sys.stderr,
            )
            return 2
        return 0
    if argv[0] != "train":
        return _command(argv)
    # From the first instant of a training job: a stop signal during its checks is one line and 75.
    from canon_titan.components.exit_codes import STOP_SIGNALS, stop_at_once_until_started

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    stop_at_once_until_started("before training started (canon-titan train was checking the run)")
    try:
        return _command(argv)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _command(argv: list[str]) -> int:
    from canon_titan.tools.startup import importing

    # A command's module imports torch and torchtitan (seconds): only the one asked for is loaded.
    with importing():
        command = importlib.import_module(f"{__name__}.{COMMANDS[argv[0]]}")
    return command.main(argv[1:])
