"""``canon-titan plan``: a run planned at its real scale on this machine (see
``canon_titan.plan``)."""

from __future__ import annotations

import argparse
import json
import sys

from canon_titan.cli.common import OVERRIDES, fail, parse_with_overrides
from canon_titan.components.exit_codes import STOPPED
from canon_titan.config import ConfigError

NOTHING_FITS = 1
"""``plan --search``'s exit status when it planned every candidate and none fits; a search whose
budget ran out before a layout that fits was planned exits ``STOPPED`` (3): a larger --budget-s may
find one."""
SEARCH_EXITS = (
    " With --search, the exit status is 0 when a layout fits, 1 when none of those "
    "it tried fits, 3 when its budget ran out before one that fits was planned, 2 for "
    "a bad config or argument."
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="canon-titan plan",
        description="Build the run as one rank (each pipeline stage) of --gpus GPUs on fake "
        "tensors, step it once, "
        "and report memory per GPU against the GPU's, FLOPs, collective volumes, step time, "
        "tokens/s per GPU, MFU and the run's GPU-hours; for a run that does not fit, the changes "
        "that make it fit. Runs on a CPU.",
        epilog=OVERRIDES + SEARCH_EXITS,
    )
    parser.add_argument("config", help="TOML run config")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the run (the world size)")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="GPUs per node (default 8): which groups cross the network",
    )
    parser.add_argument(
        "--gpu",
        default="h100",
        help="h100, h200, a100, b200, or a TOML file with the figures of "
        "another GPU (see docs/planning.md); default h100",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--no-advice", action="store_true", help="do not plan changes for a run that does not fit"
    )
    parser.add_argument(
        "--attention-backend",
        choices=("cudnn", "flash"),
        default=None,
        help="the SDPA backend attention runs on (default: the one torch picks on that GPU: "
        "cudnn on sm90/sm100, flash elsewhere); flash for torch before 2.9 on Hopper",
    )
    search = parser.add_argument_group("layout search")
    search.add_argument(
        "--search",
        action="store_true",
        help="search the layouts that keep the run's global batch (FSDP/HSDP, TP, PP, CP, the "
        "local batch and its accumulation, activation checkpointing, keeping gathered weights, "
        "float8 apart) and print the fastest that fit",
    )
    search.add_argument(
        "--top", type=int, default=5, help="with --search: how many layouts to print (default 5)"
    )
    search.add_argument(
        "--budget-s",
        type=float,
        default=580.0,
        help="with --search: wall-clock budget in seconds, from the search's start "
        "(the config's own plan, first, is not cut short); no round of plans is "
        "started that is expected to end past it (default 580)",
    )
    search.add_argument(
        "--workers",
        type=int,
        default=None,
        help="with --search: planning processes (default: one per core, at most 4)",
    )
    search.add_argument(
        "--write",
        metavar="FILE.toml",
        help="with --search: write the winner's resolved config here (the "
        "config's own layout when no other planned fits and it does)",
    )
    args, overrides = parse_with_overrides(
        parser, argv
    )  # the rest, in order: --section.key value overrides
    from canon_titan.plan.gpus import gpu_count_problem

    problem = gpu_count_problem(args.gpus, args.gpus_per_node)
    if problem:
        return fail("plan", problem)

    if not args.search:
        for flag in ("--top", "--budget-s", "--workers", "--write"):
            dest = flag[2:].replace("-", "_")
            if getattr(args, dest) != parser.get_default(dest):
                return fail("plan", f"{flag} applies to --search only")
    if args.top < 1:
        return fail("plan", f"--top must be >= 1, got {args.top}")
    if args.budget_s <= 0:
        return fail("plan", f"--budget-s must be > 0, got {args.budget_s}")
    if args.workers is not None and args.workers < 1:
        return fail("plan", f"--workers must be >= 1, got {args.workers}")
    if args.write and not args.write.endswith(".toml"):
        return fail("plan", f"--write {args.write}: expected a .toml path")

    from canon_titan.plan.gpus import UnknownGPU, find_gpu

    try:
        gpu = find_gpu(args.gpu)
    except UnknownGPU as e:
        return fail("plan", e)

    from canon_titan.plan import report
    from canon_titan.plan.planner import PlanError, plan, progress_printer

    if args.search:
        from canon_titan.plan import search

        try:
            found = search.search(
                args.config,
                overrides,
                gpus=args.gpus,
                gpu=gpu,
                gpus_per_node=args.gpus_per_node,
                top=args.top,
                budget_s=args.budget_s,
                workers=args.workers,
                attention=args.attention_backend,
                progress=progress_printer(),
            )
        except ConfigError as e:
            return fail("config", e)
        except PlanError as e:
            return fail("plan", e)
        print(
            json.dumps(search.as_dict(found), indent=2)
            if args.json
            else search.text(found, args.top)
        )
        code = 0 if found.best is not None else STOPPED if found.budget_ran_out else NOTHING_FITS
        if args.write and code:
            print(
                f"canon-titan: plan: --write {args.write}: no layout planned fits, nothing written",
                file=sys.stderr,
            )
        elif args.write:
            search.write_toml(found, args.config, overrides, args.write)
            what = (
                "the winner"
                if found.ranked
                else "the config's own layout (no other layout planned fits)"
            )
            print(f"wrote {what} to {args.write}", file=sys.stderr)  # stdout: the table or JSON
        return code
    try:
        result = plan(
            args.config,
            overrides,
            gpus=args.gpus,
            gpu=gpu,
            gpus_per_node=args.gpus_per_node,
            progress=progress_printer(),
            advise=not args.no_advice,
            attention=args.attention_backend,
        )
    except ConfigError as e:
        return fail("config", e)
    except PlanError as e:
        return fail("plan", e)
    if args.json:
        print(json.dumps(report.as_dict(result), indent=2))
    else:
        print(report.text(result))
    return 0
