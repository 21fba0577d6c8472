"""A dump folder's lock across nodes and suspended runs: the lease beside the flock (which succeeds
node-locally on Lustre ``localflock``, BeeGFS and NFS ``local_lock=flock``), never taken from a live
process of this host or a job SLURM still runs, refreshed only while it is its holder's, and seen by
every node of a run (a folder the nodes do not share is refused)."""

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import COMMON, DEBUG_CONFIG, REPO, free_port, train_env
from test_failures import interrupt

HOLD = """
import errno, fcntl, os, socket, sys, time
host, flock = sys.argv[2], sys.argv[3]
if flock == "node-local":  # succeeds whatever a process on another node holds
    fcntl.flock = lambda handle, how: None
else:  # none at all (Lustre noflock)
    def no_flock(handle, how):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    fcntl.flock = no_flock
socket.gethostname = lambda: host
from canon_titan.launch.ownership import DumpFolderInUse, lock_dump_folder
try:
    lock_dump_folder(sys.argv[1])
except DumpFolderInUse as e:
    print(f"refused: {e}", flush=True)
    sys.exit(2)
print("holding", flush=True)
time.sleep(float(sys.argv[4]))
"""


def hold(dump, host, flock):
    """A process that takes the dump folder's lock as ``host`` and keeps it; returned once it holds
    it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(dump), host, flock, "120"],
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    while not lines or lines[-1] not in ("holding\n", ""):  # "": it ended without holding
        lines.append(proc.stdout.readline())
    assert lines[-1] == "holding\n", "".join(lines)
    return proc


def _no_flock(handle, how):
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))


@pytest.fixture(autouse=True)
def released_at_the_end(monkeypatch):
    """A lease this process takes is released when the test ends, as at the process's exit (which
    also stops its refreshing)."""
    from canon_titan.components import exit_codes

    cleanups = []
    monkeypatch.setattr(exit_codes, "_cleanups", cleanups)
    yield
    for cleanup in cleanups:
        cleanup()


def test_a_node_local_flock_does_not_let_a_second_node_in(tmp_path):
    """Two nodes (two processes with two host names) on a filesystem whose flock succeeds
    node-locally: the second is refused, naming the first, both as a run and as the launcher's
    check. At 432670c the lease was used only when flock failed, so both runs owned the folder."""
    dump = tmp_path / "run"
    first = hold(dump, "node-a", "node-local")
    try:
        second = subprocess.run(
            [sys.executable, "-c", HOLD, str(dump), "node-b", "node-local", "0"],
            cwd=REPO,
            env=train_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"dump folder {dump} is in use by a run (pid {first.pid} on node-a" in second.stdout
    finally:
        first.kill()
        first.wait()


def test_a_lease_is_never_taken_from_a_live_process_of_this_host_however_long_suspended(
    tmp_path, monkeypatch
):
    """Without flock, a holder on this host stopped (SIGSTOP) for longer than the lease's expiry is
    still refused, and a lease naming a live pid that another process now has (its start time
    differs) is taken over. At 432670c a lease unrefreshed for 150 s was taken from a live,
    suspended holder: both runs trained into the same folder."""
    from canon_titan.launch import ownership

    monkeypatch.setattr(fcntl, "flock", _no_flock)
    dump = tmp_path / "run"
    lease = dump / ownership.LEASE_FILE
    holder = hold(dump, socket.gethostname(), "none")
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        then = time.time() - ownership.LEASE_EXPIRY_S - 60
        os.utime(lease, (then, then))  # what a suspension of 210 s leaves
        for check in (True, False):  # the run, and the launcher's check
            with pytest.raises(
                ownership.DumpFolderInUse, match=f"pid {holder.pid} on .*is alive on this host"
            ):
                ownership.lock_dump_folder(dump, hold=check)
        reused = {
            **json.loads(lease.read_text()),
            "pid_start": ownership._process_start(holder.pid) - 1,
        }
        lease.write_text(json.dumps(reused))  # the same pid, now another process's
        os.utime(lease, (time.time(), time.time()))
        ownership.lock_dump_folder(dump)
        assert json.loads(lease.read_text())["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize(
    "squeue, taken",
    [("RUNNING", False), ("SUSPENDED", False), ("COMPLETED", True), (None, True)],
    ids=["running", "suspended", "completed", "no_squeue"],
)
def test_a_lease_of_a_job_slurm_still_runs_is_never_taken(tmp_path, monkeypatch, squeue, taken):
    """A lease from another host, unrefreshed for longer than its expiry: taken over unless squeue
    says its SLURM job still runs (a suspended job refreshes nothing)."""
    from canon_titan.launch import ownership

    monkeypatch.setattr(fcntl, "flock", _no_flock)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if squeue is not None:
        (bin_dir / "squeue").write_text(
            f'#!/bin/sh\n[ "$*" = "--noheader --jobs 4242 --format %T" ] && echo {squeue}\n'
        )
        (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    lease = tmp_path / "run" / ownership.LEASE_FILE
    lease.parent.mkdir()
    lease.write_text(
        json.dumps(
            {
                "pid": 7,
                "host": "other-node",
                "started": "then",
                "token": "theirs",
                "refresh_s": ownership.LEASE_REFRESH_S,
                "slurm_job": "4242",
            }
        )
    )
    then = time.time() - ownership.LEASE_EXPIRY_S - 60
    os.utime(lease, (then, then))
    if taken:
        ownership.lock_dump_folder(lease.parent)
        assert json.loads(lease.read_text())["pid"] == os.getpid()
    else:
        with pytest.raises(ownership.DumpFolderInUse, match=f"its SLURM job 4242 is {squeue}"):
            ownership.lock_dump_folder(lease.parent)


def test_the_holder_refreshes_only_its_own_lease(tmp_path, monkeypatch, caplog):
    """Once another run has taken the lease over, the first run's refreshing leaves it alone (and
    says so): at 432670c it touched whatever file had the name, keeping the new holder's lease fresh
    for it."""
    from canon_titan.launch import ownership

    monkeypatch.setattr(fcntl, "flock", _no_flock)
    monkeypatch.setattr(ownership, "LEASE_REFRESH_S", 0.2)
    dump = tmp_path / "run"
    ownership.lock_dump_folder(dump)
    lease = dump / ownership.LEASE_FILE
    then = time.time() - 1000
    os.utime(lease, (then, then))
    time.sleep(1.0)
    assert time.time() - lease.stat().st_mtime < 5  # its own: refreshed
    lease.write_text(
        json.dumps(
            {"pid": 7, "host": "other-node", "started": "now", "token": "theirs", "refresh_s": 30}
        )
    )
    os.utime(lease, (then, then))
    time.sleep(1.0)
    assert lease.stat().st_mtime == pytest.approx(then, abs=1)
    assert f"the lease {lease} is no longer this run's (pid 7 on other-node" in caplog.text


@pytest.mark.slow
def test_nodes_that_do_not_share_the_dump_folder_refuse_on_every_node(tmp_path):
    """Two torchrun agents (--nnodes 2, c10d on loopback), each with a dump folder of its own, as
    nodes with node-local disks: both refuse before training, each printing the one line that names
    the fix, and neither writes a checkpoint. At 432670c both trained, each saved half of every
    checkpoint, and both exited 0."""
    port = free_port()
    procs = []
    for node in range(2):
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "canon_titan.launch.torchrun",
                    "--nnodes=2",
                    f"--node_rank={node}",
                    "--rdzv_backend=c10d",
                    f"--rdzv_endpoint=127.0.0.1:{port}",
                    f"--rdzv_id=shared-{port}",
                    "--nproc_per_node=1",
                    "-m",
                    "canon_titan.train",
                    "--config",
                    str(DEBUG_CONFIG),
                    *COMMON,
                    "--training.steps",
                    "3",
                    "--training.local_batch_size",
                    "2",
                    "--checkpoint.enable",
                    "--job.dump_folder",
                    str(tmp_path / f"node{node}"),
                ],
                cwd=REPO,
                env=train_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for node, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 2, out[-4000:]
        refusals = [line for line in out.splitlines() if line.startswith("canon-titan: ")]
        assert len(refusals) == 1 and "is not shared by every node: 1 of 2 nodes" in refusals[0], (
            out[-4000:]
        )
        assert (
            "put [job] dump_folder on a filesystem every node mounts at the same path"
            in refusals[0]
        )
        assert " step: " not in out and "Traceback" not in out, out[-4000:]
        assert not (tmp_path / f"node{node}" / "checkpoint").exists()


def test_a_folder_where_the_lease_cannot_be_made_is_one_line_and_leaves_nothing(
    tmp_path, monkeypatch
):
    """The lease is made by a hard link, which some FUSE mounts refuse: one line naming it (at
    432670c a traceback, on the filesystems without flock), and no file of it left behind."""
    from canon_titan.launch import ownership

    def no_link(src, dst):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "link", no_link)
    dump = tmp_path / "run"
    with pytest.raises(
        ownership.DumpFolderUnusable,
        match=f"cannot create the lease file {dump / ownership.LEASE_FILE}: Operation not "
        "permitted; "
        r"use a \[job\] dump_folder",
    ):
        ownership.lock_dump_folder(dump)
    assert sorted(p.name for p in dump.iterdir()) == [ownership.LOCK_FILE]


def test_a_link_whose_reply_was_lost_still_takes_and_refreshes_the_lease(tmp_path, monkeypatch):
    """NFS's non-idempotent LINK: the link is made, and the retransmitted call answers EEXIST. The
    lease is this process's, refreshed and released at exit. At 381a133 the retry found its own
    lease and returned without starting the refresh or registering the release, so another host
    took the live run's lease over 150 s later."""
    from canon_titan.components import exit_codes
    from canon_titan.launch import ownership

    monkeypatch.setattr(fcntl, "flock", _no_flock)
    monkeypatch.setattr(ownership, "LEASE_REFRESH_S", 0.2)
    link = os.link

    def link_and_lose_the_reply(src, dst):
        link(src, dst)
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))

    monkeypatch.setattr(os, "link", link_and_lose_the_reply)
    dump = tmp_path / "run"
    ownership.lock_dump_folder(dump)
    lease = dump / ownership.LEASE_FILE
    assert json.loads(lease.read_text())["pid"] == os.getpid()
    assert len(exit_codes._cleanups) == 1  # the release
    then = time.time() - 1000
    os.utime(lease, (then, then))
    time.sleep(1.0)
    assert time.time() - lease.stat().st_mtime < 5  # refreshed
    exit_codes._cleanups[0]()
    assert not lease.exists()


@pytest.mark.slow
def test_a_run_whose_lease_was_taken_over_stops_before_its_next_save(tmp_path):
    """While a run trains, another run takes its lease over: the first stops before its next save,
    exit 3 and one line naming the new holder, and writes no checkpoint after it. At 381a133 it
    logged an error and kept training and saving into the folder the other run now owned."""
    dump = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "canon_titan.launch.torchrun",
        "--standalone",
        "--nproc_per_node",
        "1",
        str(REPO / "tests" / "fast_lease_rank.py"),
        "--config",
        str(DEBUG_CONFIG),
        *COMMON,
        "--training.steps",
        "40",
        "--training.local_batch_size",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "6",
        "--job.dump_folder",
        str(dump),
    ]
    other = {"pid": 7, "host": "other-node", "started": "now", "token": "theirs", "refresh_s": 30}

    def take_over(proc):
        (dump / ".canon-titan.lease").write_text(json.dumps(other))

    code, out = interrupt(cmd, "step:  2", take_over)
    said = [line for line in out.splitlines() if line.startswith("canon-titan: ")]
    assert code == 3, out[-4000:]
    assert said and "is no longer this run's (pid 7 on other-node" in said[-1], out[-4000:]
    assert "this run stops before its next save" in said[-1]
    assert not (dump / "checkpoint").exists() or not list((dump / "checkpoint").iterdir()), out[
        -4000:
    ]
