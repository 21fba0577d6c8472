"""``canon-titan report``."""

from __future__ import annotations

import argparse

from canon_titan.cli.common import fail
from canon_titan.evaluation.report import ReportError, write_report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="canon-titan report",
        description="loss and eval metrics vs tokens for several runs side by side",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="dump folders of training runs")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument(
        "--html", help="also a self-contained HTML page (figure inline, last values)"
    )
    parser.add_argument(
        "--labels", help="comma-separated names, one per run (default: [job] description or folder)"
    )
    parser.add_argument(
        "--smooth", type=float, default=0.0, help="EMA factor for the loss curve, 0 <= s < 1"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.smooth < 1:
        parser.error("--smooth must be in [0, 1)")

    try:
        runs = write_report(
            args.runs,
            args.out,
            args.html,
            args.labels.split(",") if args.labels else None,
            args.smooth,
        )
    except ReportError as e:
        return fail("report", e)
    print(f"[report] {len(runs)} runs -> {args.out}" + (f" and {args.html}" if args.html else ""))
    return 0
