"""``canon-titan train``: a single-node torchrun launch, after the checks the workers would stop
on."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from canon_titan.cli.common import OVERRIDES, fail, parse_with_overrides
from canon_titan.components.exit_codes import (
    OUTCOME_DIR_ENV,
    REFUSED,
    STOP_SIGNALS,
    STOPPED,
    STOPPED_EXIT_CODES,
)
from canon_titan.config.build import build_trainer_config
from canon_titan.config.titan_sections import load_or_report
from canon_titan.launch.ownership import torchrun_preexec
from canon_titan.launch.prelaunch import CHECKED_ENV, check_launch


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="canon-titan train",
        description="Single-node training launch (torchrun --standalone).",
        epilog=OVERRIDES,
    )
    parser.add_argument("--config", required=True)
    parser.add_argument(
        "--nproc", type=int, default=1, help="processes (GPUs, or CPU ranks) on this node"
    )
    parser.add_argument(
        "--log-ranks",
        help="ranks whose output is shown (torchrun --local-ranks-filter; default: "
        "rank 0, or with pipeline parallelism the first rank of the last stage, which has "
        "the loss)",
    )
    args, overrides = parse_with_overrides(parser, argv)  # --section.key overrides pass through
    if args.nproc < 1:
        parser.error("--nproc must be >= 1")
    os.environ["WORLD_SIZE"] = str(args.nproc)
    run, error = load_or_report(args.config, overrides, build=build_trainer_config)
    del os.environ["WORLD_SIZE"]
    if error:
        return fail("config", error)
    # What the workers would stop on before training, checked before torchrun starts (they skip it).
    verdict = check_launch(run, args.nproc)
    for message in verdict.warnings:
        print(f"canon-titan: warning: {message}", file=sys.stderr)
    if verdict.problem:
        print(f"canon-titan: {verdict.problem}", file=sys.stderr)
        return REFUSED
    log_ranks = args.log_ranks
    if log_ranks is None:
        pp = run["parallelism"]["pipeline_parallel_degree"]
        log_ranks = str((pp - 1) * args.nproc // pp)
    # The wrapper gives the workers the run's stop grace before it kills them. torchrun's per-rank
    # output copies and the workers' exit reports go to a folder of this launcher's on the local
    # temporary disk (never the dump folder, whose disk may be the full one), which it removes even
    # when torchrun is killed.
    scratch = Path(tempfile.mkdtemp(prefix="canon-titan-"))
    cmd = [
        sys.executable,
        "-m",
        "canon_titan.launch.torchrun",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "--local-ranks-filter",
        log_ranks,
        "--role",
        "rank",
        "--tee",
        "3",
        "--log-dir",
        str(scratch / "logs"),
        "-m",
        "canon_titan.train",
        "--config",
        args.config,
        *overrides,
    ]
    print("+ " + " ".join(cmd), flush=True)

    env = dict(
        os.environ, CANON_TITAN_COLOR="1" if sys.stdout.isatty() else "0", **{CHECKED_ENV: "1"}
    )
    env[OUTCOME_DIR_ENV] = str(scratch / "exits")
    os.mkdir(env[OUTCOME_DIR_ENV])
    # Share the cores between the processes (torchrun would default to 1 and print a banner saying
    # so).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    code = None
    try:
        code = _run_torchrun(cmd, env)
        if code < 0:
            print(
                f"canon-titan: torchrun was killed by {signal.Signals(-code).name}, and "
                "its training processes with "
                f"it (nothing of the step they reached was saved); {_on_disk(run)}",
                file=sys.stderr,
            )
            code = STOPPED
        return code
    finally:
        # After a failure of its own, torchrun's report names its log files: those stay.
        shutil.rmtree(
            scratch if code in (0, *STOPPED_EXIT_CODES) else scratch / "exits", ignore_errors=True
        )


def _on_disk(run) -> str:
    """What there is to resume from, in words."""
    from canon_titan.components.checkpointer import newest_checkpoint_line

    if not run["checkpoint"]["enable"]:
        return (
            "checkpointing is off ([checkpoint] enable = false), so there is nothing to resume from"
        )
    return newest_checkpoint_line(Path(run["job"]["dump_folder"]) / run["checkpoint"]["folder"])


def _run_torchrun(cmd: list[str], env: dict) -> int:
    """Start torchrun and wait for it. SIGTERM, SIGINT or SIGUSR1 to this process is passed on to
    torchrun (which passes it to its workers: they save and exit); the launcher keeps waiting
    instead of dying, which would take torchrun and its workers down before they saved."""
    proc = subprocess.Popen(cmd, preexec_fn=torchrun_preexec, env=env)

    def forward(signum, frame):
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
