"""What a run promises about its dump folder and its saves, checked where the promise could break:
the lease file that stands in for ``flock`` (exclusive creation under a race, removal on an
``os._exit``, takeover once its run is over, here or on another host), no asynchronous save (its
guarantees are not those of a save that returns complete), settings that are honoured rather than
dropped, and the parameters' finiteness check at one host sync per save."""

import errno
import fcntl
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
import types

import pytest
import torch

from conftest import DEBUG_CONFIG, REPO, train_env


def _no_flock(handle, how):
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))  # Lustre mounted noflock


@pytest.fixture
def ownership(monkeypatch):
    from canon_titan.launch import ownership

    monkeypatch.setattr(fcntl, "flock", _no_flock)
    return ownership


def _contend(dump, barrier, results):
    fcntl.flock = _no_flock
    from canon_titan.launch import ownership

    barrier.wait()
    try:
        ownership.lock_dump_folder(dump)
        results.put("took")
        time.sleep(3)  # held while the others try
    except ownership.DumpFolderInUse:
        results.put("refused")


def test_of_processes_that_take_a_lease_at_once_exactly_one_wins(tmp_path):
    """Eight processes released together onto a folder without flock, five times: each time one
    holds the lease and the others are refused. At 4a7b0a2 the lease was read, then written, so
    processes that read before any wrote all went ahead."""
    ctx = multiprocessing.get_context("fork")
    for attempt in range(5):
        dump = tmp_path / f"run{attempt}"
        dump.mkdir()
        barrier, results = ctx.Barrier(8), ctx.Queue()
        procs = [ctx.Process(target=_contend, args=(dump, barrier, results)) for _ in range(8)]
        for p in procs:
            p.start()
        outcomes = sorted(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        assert outcomes == ["refused"] * 7 + ["took"], (attempt, outcomes)


HOLD_THEN_RUN_OUT_OF_GRACE = """
import fcntl, errno, os, signal, sys, time
def no_flock(handle, how):
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
fcntl.flock = no_flock
from canon_titan.components.preemption import StopSignals
from canon_titan.launch.ownership import lock_dump_folder
lock_dump_folder(sys.argv[1])
StopSignals(1).install()
print("holding", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)
"""


@pytest.mark.slow
def test_a_lease_goes_when_its_process_ends_by_os_exit(tmp_path):
    """A run holding the lease that exits with ``os._exit`` (its grace period ran out after a stop
    signal) leaves no lease behind: a requeued run on any host is not refused. At 4a7b0a2 the lease
    was removed at atexit only, which ``os._exit`` skips."""
    from canon_titan.launch.ownership import LEASE_FILE

    dump = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", HOLD_THEN_RUN_OUT_OF_GRACE, str(dump)],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3 and "holding" in proc.stdout, proc.stderr[-3000:]
    assert "no checkpoint saved within" in proc.stderr
    assert not (dump / LEASE_FILE).exists()


def _write_lease(path, age=0.0, **holder):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": 4242, "host": "other-node", "started": "then", **holder}))
    then = time.time() - age
    os.utime(path, (then, then))


def test_a_lease_of_a_run_that_is_over_is_taken_over_and_a_live_one_refused(
    tmp_path, ownership, monkeypatch
):
    """A lease from another host cannot be checked by pid. It is over when an earlier run of this
    SLURM job wrote it (the job was requeued, on another node) or when its holder stopped refreshing
    it; then the run takes it over. Otherwise, and for a lease that never said it would be
    refreshed, it is refused. At 4a7b0a2 every lease from another host was refused until deleted by
    hand."""
    lease = tmp_path / "run" / ownership.LEASE_FILE
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    fresh = {"refresh_s": ownership.LEASE_REFRESH_S}
    cases = [  # (the lease, whether it is taken over)
        (
            {**fresh, "slurm_job": "777", "slurm_restart": 0, "slurm_step": "0"},
            True,
        ),  # requeued job
        (
            {**fresh, "slurm_job": "777", "slurm_restart": 1, "slurm_step": "1"},
            False,
        ),  # another step, now
        ({**fresh, "slurm_job": "778", "slurm_restart": 0}, False),  # another job
        ({**fresh, "age": ownership.LEASE_EXPIRY_S + 60}, True),  # no longer refreshed
        ({**fresh, "age": ownership.LEASE_REFRESH_S * 2}, False),  # refreshed a moment ago
        ({"age": 10 * ownership.LEASE_EXPIRY_S}, False),  # never refreshed: cannot be judged
    ]
    for holder, taken in cases:
        _write_lease(lease, **holder)
        if taken:
            ownership.lock_dump_folder(lease.parent)
            assert json.loads(lease.read_text())["pid"] == os.getpid(), holder
            lease.unlink()  # as the process would at its exit
        else:
            with pytest.raises(ownership.DumpFolderInUse, match="pid 4242 on other-node"):
                ownership.lock_dump_folder(lease.parent)
            with pytest.raises(ownership.DumpFolderInUse):
                ownership.lock_dump_folder(lease.parent, hold=False)  # the launcher's check agrees


def test_async_checkpointing_is_refused_naming_the_key_and_the_allowed_value(tmp_path):
    """``[checkpoint] async_mode`` would return from a save once staged: its write errors never
    reach the one-line path, "saved" (and exit 75) would come before the files are complete, and
    keep_latest_k would purge the older checkpoints first. The config check refuses it (at 4a7b0a2
    it was accepted)."""
    from canon_titan.config import ConfigError, load

    for mode in ("async", "async_with_pinned_mem"):
        with pytest.raises(ConfigError) as refused:
            load(DEBUG_CONFIG, ["--checkpoint.async_mode", mode], environment=False)
        message = str(refused.value)
        assert "[checkpoint] async_mode" in message and f"is '{mode}'" in message, message
        assert "only 'disabled' is supported" in message
    config = tmp_path / "async.toml"
    config.write_text(
        DEBUG_CONFIG.read_text().replace("[checkpoint]", '[checkpoint]\nasync_mode = "async"', 1)
    )
    with pytest.raises(ConfigError, match=f"^{config}: \\[checkpoint\\] async_mode"):
        load(config, [], environment=False)
    load(DEBUG_CONFIG, ["--checkpoint.async_mode", "disabled"], environment=False)


def test_fsdp_symmetric_memory_reaches_torchtitans_fsdp(monkeypatch):
    """``[parallelism] enable_fsdp_symm_mem`` is handed to TorchTitan's FSDP (at 4a7b0a2 it was
    accepted and dropped)."""
    import inspect

    from canon_titan.models.common import parallelize

    real = parallelize.apply_fsdp_to_decoder
    calls = []
    monkeypatch.setattr(parallelize, "apply_fsdp_to_decoder", lambda *a, **k: calls.append((a, k)))
    for wanted in (True, False):
        parallelize.apply_ac_compile_fsdp(
            torch.nn.Linear(2, 2),
            parallel_dims=types.SimpleNamespace(
                dp_replicate_enabled=False, pp_enabled=False, get_mesh=lambda names: None
            ),
            training=types.SimpleNamespace(
                mixed_precision_param="float32",
                mixed_precision_reduce="float32",
                enable_cpu_offload=False,
            ),
            parallelism=types.SimpleNamespace(
                fsdp_reshard_after_forward="default", enable_fsdp_symm_mem=wanted
            ),
            compile_config=types.SimpleNamespace(enable=False, components=[]),
            ac_config=None,
            dump_folder="",
        )
        args, kwargs = calls.pop()
        assert kwargs["enable_symm_mem"] is wanted
        inspect.signature(real).bind(*args, **kwargs)  # what TorchTitan's function takes


class HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (``.item()``, ``bool(t)``, ``if t:``): each
    is ``aten._local_scalar_dense``, a device-to-host sync on an accelerator."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, _types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def checkpointer_over(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None = None
):
    """A CanonCheckpointer's checks over ``params`` (and ``optimizer``'s state), without a run."""
    from canon_titan.components.checkpointer import CanonCheckpointer

    checkpointer = CanonCheckpointer.__new__(CanonCheckpointer)
    checkpointer.enable, checkpointer.folder, checkpointer.checked, checkpointer.damaged = (
        True,
        "nowhere",
        set(),
        set(),
    )
    checkpointer.stager = None  # what TorchTitan's close (from __del__) reads of a built one
    checkpointer.states = {
        "model": types.SimpleNamespace(model=[torch.nn.ParameterList(params)]),
        "optimizer": [optimizer] if optimizer is not None else [],
    }
    return checkpointer


@pytest.mark.parametrize("where", ["parameters", "optimizer state"])
@pytest.mark.parametrize("broken", [None, math.nan, math.inf])
def test_the_finiteness_check_covers_the_optimizer_state_and_syncs_with_the_host_once(
    broken, where
):
    """Before a save, whether every parameter and every optimizer state tensor is finite costs one
    host sync, whatever their number (at 4a7b0a2: one per parameter, 30 here, and the optimizer
    state was not checked at all), and still finds a NaN or inf in the last one (naming which of the
    two holds it, with one more sync), while a large finite value passes."""
    from canon_titan.components.checkpointer import NonFiniteParameters

    params = [torch.nn.Parameter(torch.randn(3, 5)) for _ in range(30)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params)
    optimizer.step()
    with torch.no_grad():
        params[0][0, 0] = 3e38  # finite: its square is not
        if broken is not None:
            target = (
                params[-1] if where == "parameters" else optimizer.state[params[-1]]["exp_avg_sq"]
            )
            target[2, 4] = broken
    checkpointer = checkpointer_over(params, optimizer)
    with HostSyncs() as syncs:
        if broken is None:
            checkpointer._check_finite(7)
        else:
            verb = "are" if where == "parameters" else "is"
            with pytest.raises(
                NonFiniteParameters, match=f"the {where} at step 7 {verb} not finite"
            ):
                checkpointer._check_finite(7)
    assert syncs.count == (1 if broken is None else 2)


def _decide_on_two_ranks(rank: int, port: int, results) -> None:
    import datetime

    import torch.distributed as dist

    from canon_titan.tools.collectives import rank_zero_decides
    from canon_titan.trainer import RESUME_REFUSALS

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )

    def decide():
        raise PermissionError(errno.EACCES, "Permission denied", "/runs/x/checkpoint")

    try:
        rank_zero_decides(decide, "where to resume", refusals=RESUME_REFUSALS)
        results.put((rank, "returned"))
    except Exception as e:  # what each rank stops with
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def test_a_failure_of_rank_zeros_resume_decision_stops_every_rank():
    """Rank 0 alone reads the checkpoint folder; when that fails with anything but a refusal (here a
    folder it may not read), every rank stops with it at once instead of waiting for rank 0's answer
    until the collective's timeout."""
    from conftest import free_port

    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_decide_on_two_ranks, args=(rank, port, results)) for rank in range(2)
    ]
    started = time.monotonic()
    for p in procs:
        p.start()
    outcome = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert outcome[0].startswith("PermissionError: [Errno 13] Permission denied"), outcome
    assert outcome[1] == (
        "RankZeroFailed: rank 0 could not decide where to resume: "
        "PermissionError: [Errno 13] Permission denied: "
        "'/runs/x/checkpoint'"
    ), outcome
    assert time.monotonic() - started < 60
