"""What the training processes would stop on before training, checked once before any rank builds
or loads, whatever launched them (``canon-titan train``, ``scripts/run_train.sh``, torchrun,
SLURM): a live run in the dump folder, no loadable checkpoint to resume from, a finished run, a
checkpoint that cannot continue this run (``check_resume``).

Under torchrun, rank 0 decides and every rank gets its verdict through torchrun's own store, so no
rank goes on to build, load or wait in a collective for a rank that refused."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from torch.distributed import DistStoreError

from canon_titan.components.checkpointer import refuse_saves
from canon_titan.components.resume_checks import ResumeRefused, check_resume
from canon_titan.config import run_toml
from canon_titan.config.build import absolute_paths
from canon_titan.config.titan_sections import CHECKED_ENV
from canon_titan.convert.dcp_io import NoLoadableCheckpoint
from canon_titan.data.fingerprint import data_fingerprint
from canon_titan.launch.ownership import (
    DumpFolderInUse,
    DumpFolderUnusable,
    check_shared,
    held_lease_token,
    lock_dump_folder,
)
from canon_titan.tools.collectives import rank_zero_decides, store_barrier
from canon_titan.trainer import RUN_CONFIG_FILE, FinishedRun, config_changes, resume_point

VERDICT_WAIT = timedelta(minutes=30)
"""How long a rank waits for rank 0's verdict (rank 0 reads checkpoint metadata and the data's
fingerprint)."""
TOLD_WAIT = timedelta(seconds=60)
"""How long a refusing rank waits for the other ranks to have the refusal."""


class Verdict:
    """The outcome of the checks: ``problem`` (one line) when the run must not start, and the
    warnings to show."""

    def __init__(self, problem: str | None = None, warnings: list[str] | None = None):
        self.problem = problem
        self.warnings = warnings or []


def check_launch(
    run, world_size: int, *, lock: str = "check", compare_config: bool = True
) -> Verdict:
    """Every check that needs only the run config and the files on disk. ``lock``: "check" that no
    live run holds the dump folder, "hold" its lock for this process (the training process of rank
    0), or "skip" it (another rank of the same job holds it)."""
    dump = run["job"]["dump_folder"]
    warnings: list[str] = []
    try:
        if lock != "skip":
            lock_dump_folder(dump, hold=lock == "hold", on_lost=refuse_saves)
        ckpt = run["checkpoint"]
        if ckpt["enable"]:
            folder = Path(dump) / ckpt["folder"]
            step, skipped = resume_point(
                str(folder), ckpt["load_step"], run["training"]["steps"], dump
            )
            warnings += skipped
            if step >= 0 and not ckpt["load_only"]:
                warnings += _resume_warnings(run, folder / f"step-{step}", world_size)
    except (
        DumpFolderInUse,
        DumpFolderUnusable,
        NoLoadableCheckpoint,
        FinishedRun,
        ResumeRefused,
    ) as e:
        return Verdict(str(e), warnings)
    if compare_config:
        written = run_toml(run, absolute_paths(run.sections), record=True)
        changes = config_changes(os.path.join(dump, RUN_CONFIG_FILE), written)
        if changes:
            warnings.append(
                f"the config differs from the one of the run already in {dump}: {changes}"
            )
    return Verdict(None, warnings)


def _resume_warnings(run, step_dir: Path, world_size: int) -> list[str]:
    """``check_resume`` with what the workers will have: the model's tensors, the data's
    fingerprint, the data-parallel size and the global batch at ``world_size`` processes."""
    data, training = run["dataloader"], run["training"]
    dp_size = run.data_parallel_size(world_size)
    global_batch = training["global_batch_size"]
    if global_batch <= 0:
        global_batch = training["local_batch_size"] * dp_size
    verdict = check_resume(
        step_dir,
        shapes=run.state_dict_adapter().shapes,
        model=run.label(),
        fingerprint=data_fingerprint(data["dataset"], data["dataset_path"], data["sources"]),
        allow_changed_data=data["allow_changed_data"],
        dp_size=dp_size,
        global_batch=global_batch,
        batch_explicit=training["global_batch_size"] > 0,
    )
    return verdict.warnings


def agreed_verdict(run) -> Verdict:
    """In a training process: rank 0's verdict, for every rank. Rank 0 takes the dump folder's lock
    and, unless ``canon-titan train`` already did, runs the checks; the other ranks wait for what it
    decided; on several nodes, every node then checks that it sees the lease rank 0 took. Only rank
    0's verdict carries warnings (the others would repeat them)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    store = _launcher_store() if world_size > 1 else None
    if (
        store is None
    ):  # one process, or started without torchrun's agent: each rank checks for itself
        verdict = _decide(run, world_size, lock="hold" if rank == 0 else "skip")
        return verdict if rank == 0 else Verdict(verdict.problem)
    dump = run["job"]["dump_folder"]

    def decide() -> tuple[str | None, list[str], str | None]:
        verdict = _decide(run, world_size)
        token = None if verdict.problem else held_lease_token(dump)
        return verdict.problem, verdict.warnings, token

    problem, warnings, token = rank_zero_decides(
        decide, "launch-verdict", timeout=VERDICT_WAIT, store=store
    )
    verdict = Verdict(problem, warnings if rank == 0 else [])
    if verdict.problem is None:
        verdict.problem = check_shared(store, dump, token)
    if verdict.problem:
        _until_every_rank_has_it(store)
    return verdict


def _until_every_rank_has_it(store) -> None:
    """Hold a refusing rank until every rank has the refusal (or ``TOLD_WAIT`` passed): the store
    lives in a node's torchrun agent, which ends once its ranks do, and a rank that asked after that
    would end on a connection error instead of the refusal's line."""
    try:
        store_barrier("launch-refusal-told", TOLD_WAIT, store=store)
    except DistStoreError:  # a rank that never came (it died): the others have said why
        pass


def _decide(run, world_size: int, lock: str = "hold") -> Verdict:
    if (
        os.environ.get(CHECKED_ENV) == "1"
    ):  # the launcher checked and warned; only the lock is left to take
        try:
            if lock == "hold":
                lock_dump_folder(run["job"]["dump_folder"], on_lost=refuse_saves)
            return Verdict(None)
        except (DumpFolderInUse, DumpFolderUnusable) as e:
            return Verdict(str(e))
    # The trainer itself compares the config with the folder's and says so; not twice.
    return check_launch(run, world_size, lock=lock, compare_config=False)


def _launcher_store():
    """A client of the store torchrun's agent serves to its workers (the one their process group
    will use), or None when the processes were not started by torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed import TCPStore

    return TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=VERDICT_WAIT,
    )
