"""``canon-titan plan``: a run planned at its real scale on this machine (see ``canon_titan.plan``)."""

from __future__ import annotations

import argparse
import json

from canon_titan.cli.common import OVERRIDES, fail, parse_with_overrides
from canon_titan.config import ConfigError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="canon-titan plan",
        description="Build the run as one rank (each pipeline stage) of --gpus GPUs on fake tensors, step it once, "
                    "and report memory per GPU against the GPU's, FLOPs, collective volumes, step time, "
                    "tokens/s per GPU, MFU and the run's GPU-hours; for a run that does not fit, the changes "
                    "that make it fit. Runs on a CPU.",
        epilog=OVERRIDES)
    parser.add_argument("config", help="TOML run config")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the run (the world size)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8): which groups "
                        "cross the network")
    parser.add_argument("--gpu", default="h100", help="h100, h200, a100, b200, or a TOML file with the figures of "
                        "another GPU (see the README); default h100")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--no-advice", action="store_true", help="do not plan changes for a run that does not fit")
    args, overrides = parse_with_overrides(parser, argv)  # the rest, in order: --section.key value overrides
    if args.gpus < 1:
        return fail("plan", f"--gpus must be >= 1, got {args.gpus}")
    if args.gpus_per_node < 1:
        return fail("plan", f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")

    from canon_titan.plan.gpus import UnknownGPU, find_gpu

    try:
        gpu = find_gpu(args.gpu)
    except UnknownGPU as e:
        return fail("plan", e)

    from canon_titan.plan import report
    from canon_titan.plan.planner import PlanError, plan, progress_printer

    try:
        result = plan(args.config, overrides, gpus=args.gpus, gpu=gpu, gpus_per_node=args.gpus_per_node,
                      progress=progress_printer(), advise=not args.no_advice)
    except ConfigError as e:
        return fail("config", e)
    except PlanError as e:
        return fail("plan", e)
    if args.json:
        print(json.dumps(report.as_dict(result), indent=2))
    else:
        print(report.text(result))
    return 0
