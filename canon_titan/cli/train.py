"""``canon-titan train``: a single-node torchrun launch, after the checks the workers would stop on."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from canon_titan.cli.common import OVERRIDES, fail, load_or_report
from canon_titan.components.exit_codes import STOP_SIGNALS, STOPPED_EXIT_CODES
from canon_titan.config import dumps
from canon_titan.config.build import absolute_paths, build_trainer_config
from canon_titan.convert.dcp_io import NoLoadableCheckpoint
from canon_titan.data.fingerprint import data_fingerprint
from canon_titan.launch.ownership import DumpFolderInUse, DumpFolderUnusable, lock_dump_folder, torchrun_preexec
from canon_titan.launch.resume_checks import ResumeRefused, check_resume
from canon_titan.trainer import RUN_CONFIG_FILE, FinishedRun, config_changes, resume_point


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="canon-titan train", description="Single-node training launch (torchrun --standalone).", epilog=OVERRIDES)
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs, or CPU ranks) on this node")
    parser.add_argument("--log-ranks", help="ranks whose output is shown (torchrun --local-ranks-filter; default: "
                        "rank 0, or with pipeline parallelism the first rank of the last stage, which has the loss)")
    args, overrides = parser.parse_known_args(argv)  # --section.key overrides pass through
    if args.nproc < 1:
        parser.error("--nproc must be >= 1")
    os.environ["WORLD_SIZE"] = str(args.nproc)
    run, error = load_or_report(args.config, overrides, build=build_trainer_config)
    del os.environ["WORLD_SIZE"]
    if error:
        return fail("config", error)
    error = _prepare_launch(run, args.nproc)
    if error:
        print(f"canon-titan: {error}", file=sys.stderr)
        return 2
    log_ranks = args.log_ranks
    if log_ranks is None:
        pp = run["parallelism"]["pipeline_parallel_degree"]
        log_ranks = str((pp - 1) * args.nproc // pp)
    # torchrun's per-rank copies of the output (what --tee shows comes from them) go to the local temporary
    # disk, never the dump folder: a full checkpoint disk must not silence the ranks' own messages.
    log_dir = Path(tempfile.mkdtemp(prefix="torchelastic_"))
    # torchrun waits this long for its workers after passing a signal on, before it SIGKILLs them.
    shutdown_timeout = run["job"]["stop_grace_seconds"] + 30
    cmd = [sys.executable, "-m", "canon_titan.launch.torchrun", "--standalone", f"--nproc_per_node={args.nproc}",
           "--local-ranks-filter", log_ranks, "--role", "rank", "--tee", "3", "--log-dir", str(log_dir),
           "--shutdown-timeout", str(shutdown_timeout),
           "-m", "canon_titan.train", "--config", args.config, *overrides]
    print("+ " + " ".join(cmd), flush=True)

    env = dict(os.environ, CANON_TITAN_COLOR="1" if sys.stdout.isatty() else "0")
    # Share the cores between the processes (torchrun would default to 1 and print a banner saying so).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    code = _run_torchrun(cmd, env)
    if code in (0, *STOPPED_EXIT_CODES):  # each rank has said what happened; else torchrun's report names the files
        shutil.rmtree(log_dir, ignore_errors=True)
    return code


def _run_torchrun(cmd: list[str], env: dict) -> int:
    """Start torchrun and wait for it. SIGTERM, SIGINT or SIGUSR1 to this process is passed on to torchrun
    (which passes it to its workers: they save and exit); the launcher keeps waiting instead of
    dying, which would take torchrun and its workers down before they saved."""
    proc = subprocess.Popen(cmd, preexec_fn=torchrun_preexec, env=env)

    def forward(signum, frame):
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _prepare_launch(run, nproc: int) -> str | None:
    """What the workers would stop on before training, checked before torchrun starts: TorchTitan's
    own config checks, a live run in the dump folder, no loadable checkpoint to resume from, a
    checkpoint that cannot continue this run (``check_resume``). Prints the checkpoints that will
    be skipped. Returns the error, or None."""
    dump = run["job"]["dump_folder"]
    try:
        lock_dump_folder(dump, hold=False)
        ckpt = run["checkpoint"]
        if ckpt["enable"]:
            folder = Path(dump) / ckpt["folder"]
            step, skipped = resume_point(str(folder), ckpt["load_step"], run["training"]["steps"], dump)
            for message in skipped:
                print(f"canon-titan: warning: {message}", file=sys.stderr)
            if step >= 0 and not ckpt["load_only"]:
                _check_resume(run, folder / f"step-{step}", nproc)
    except (DumpFolderInUse, DumpFolderUnusable, NoLoadableCheckpoint, FinishedRun, ResumeRefused) as e:
        return str(e)
    changes = config_changes(os.path.join(dump, RUN_CONFIG_FILE), dumps(absolute_paths(run.sections)))
    if changes:
        print(f"canon-titan: warning: the config differs from the one of the run already in {dump}: {changes}",
              file=sys.stderr)
    return None


def _check_resume(run, step_dir: Path, nproc: int) -> None:
    """``check_resume`` with what the workers will have: the model's tensors, the data's
    fingerprint, the data-parallel size and the global batch at ``nproc`` processes."""
    data, training = run["dataloader"], run["training"]
    dp_size = run.data_parallel_size(nproc)
    global_batch = training["global_batch_size"]
    if global_batch <= 0:
        global_batch = training["local_batch_size"] * dp_size
    verdict = check_resume(step_dir, shapes=run.state_dict_adapter().shapes, model=run.label(),
                           fingerprint=data_fingerprint(data["dataset"], data["dataset_path"], data["sources"]),
                           allow_changed_data=data["allow_changed_data"], dp_size=dp_size, global_batch=global_batch,
                           batch_explicit=training["global_batch_size"] > 0)
    for message in verdict.warnings:
        print(f"canon-titan: warning: {message}", file=sys.stderr)
