"""Who owns a training job's processes, and which job owns a dump folder.

``canon-titan train`` starts torchrun, torchrun starts the workers (each in a session of its own,
so a signal to the launcher's process group does not reach them). Both links are tied with Linux's
parent-death signal: torchrun gets SIGTERM when the launcher dies (and stops its workers as it
does for a SIGTERM), a worker gets SIGKILL when its torchrun agent dies. Whatever kills the
launcher, SIGKILL included, no worker trains on unseen.

A dump folder holds one live run: global rank 0 keeps an exclusive ``flock`` on
``{dump_folder}/.canon-titan.lock`` for the run's life (the kernel drops it when the process dies,
however it dies), and a second run there stops before training with the holder's pid, host and
start time. The launcher checks the same lock before it starts torchrun. Where the filesystem has
no working ``flock`` (any error but "held by another": ENOLCK, EOPNOTSUPP, ENOSYS on Lustre ``noflock``,
EINVAL, ...), a lease file stands in for it, with a warning: created exclusively, refreshed by its
holder, removed on every exit the process makes on purpose, and taken over once its run is over.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from torchtitan.tools.logging import logger

from canon_titan.components.exit_codes import before_exit
from canon_titan.tools.fileio import write_atomic
from canon_titan.tools.processes import pid_alive

LOCK_FILE = ".canon-titan.lock"
LEASE_FILE = ".canon-titan.lease"
_PR_SET_PDEATHSIG = 1
_held: list = []


def die_with_parent(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the parent exited before the request took effect
        os.kill(os.getpid(), sig)


def torchrun_preexec() -> None:
    """``preexec_fn`` for the launcher's torchrun: SIGTERM it when the launcher exits."""
    die_with_parent(signal.SIGTERM)


class DumpFolderInUse(RuntimeError):
    pass


class DumpFolderUnusable(RuntimeError):
    pass


def _describe_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (OSError, ValueError, KeyError):
        return "another process"


def lock_dump_folder(dump_folder: str | os.PathLike, *, hold: bool = True) -> None:
    """Take the dump folder's run lock (kept open for the process's life when ``hold``), or raise
    DumpFolderInUse naming the live run that has it, or DumpFolderUnusable when the lock file
    cannot be opened. On a filesystem without ``flock`` the lock is a pid/host lease file."""
    folder = Path(dump_folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    try:
        handle = open(path, "a+")
    except OSError as e:
        raise DumpFolderUnusable(f"cannot open the lock file {path}: {e.strerror or e} (another user's folder, or "
                                 "read-only?); use a [job] dump_folder this user can write") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        handle.close()
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # no working flock here, whatever it says
            _take_lease(folder, hold)
            return
        raise DumpFolderInUse(f"dump folder {folder} is in use by a live run ({_describe_holder(path)}); wait for "
                              "it to end or stop it, or use another [job] dump_folder") from None
    if not hold:
        handle.close()
        return
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps(_holder()))
    handle.flush()
    _held.append(handle)


def _holder() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds")}


LEASE_REFRESH_S = 30
"""How often the holder of a lease touches it (a thread), so that a reader on any host can tell a
live holder from one that died without removing it (SIGKILL, a lost node)."""
LEASE_EXPIRY_S = 150
"""A refreshed lease untouched for this long belongs to a run that is over (five refreshes missed;
the margin also covers clocks of different hosts that disagree by a minute)."""


def _lease_holder() -> dict:
    """What a lease records: the process, and the SLURM job and requeue count it belongs to."""
    return {**_holder(), "refresh_s": LEASE_REFRESH_S, "token": os.urandom(8).hex(),
            "slurm_job": os.environ.get("SLURM_JOB_ID"), "slurm_step": os.environ.get("SLURM_STEP_ID"),
            "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)}


def _ended(holder: dict | None, age: float) -> str | None:
    """Why the run that wrote a lease is over (None: it may be live). ``age``: seconds since the
    lease was last touched."""
    if holder is None:
        return "the lease file is unreadable"
    here = holder.get("host") == socket.gethostname()
    if here and not pid_alive(holder.get("pid")):
        return f"its process {holder.get('pid')} on this host has ended"
    job = os.environ.get("SLURM_JOB_ID")
    if job and holder.get("slurm_job") == job:
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        if int(holder.get("slurm_restart") or 0) < restart:
            return f"it was written before SLURM requeued job {job} (requeue {holder.get('slurm_restart')} < {restart})"
        if not here and holder.get("slurm_step") == os.environ.get("SLURM_STEP_ID"):
            return f"it was written on another node of this job step (SLURM job {job}), not by another run"
    if holder.get("refresh_s") and age > LEASE_EXPIRY_S:
        return f"it has not been refreshed for {age:.0f} s (its holder refreshes it every {holder['refresh_s']} s)"
    return None


def _read_lease(lease: Path) -> tuple[str, float] | None:
    """The lease's text and seconds since it was last touched, or None when there is none."""
    try:
        with open(lease) as f:
            return f.read(), time.time() - os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DumpFolderUnusable(f"cannot read the lease file {lease}: {e.strerror or e}; use a [job] dump_folder "
                                 "this user can write") from None


def _parse(text: str) -> dict | None:
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _create_exclusive(lease: Path, text: str) -> bool:
    """Create ``lease`` holding ``text`` unless it exists: a complete temporary file hard-linked to
    the name (link fails when the name exists, atomically even on NFS, and no reader ever sees a
    half-written lease). False when another process has it."""
    tmp = lease.with_name(f"{lease.name}.{socket.gethostname()}.{os.getpid()}.new")
    write_atomic(tmp, text)
    try:
        os.link(tmp, lease)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _remove_if_unchanged(lease: Path, text: str) -> bool:
    """Remove the lease judged stale, unless another process replaced it meanwhile: it is renamed
    to a name of this process's own (only one remover wins), compared, and put back if it changed."""
    mine = lease.with_name(f"{lease.name}.{socket.gethostname()}.{os.getpid()}.old")
    try:
        os.rename(lease, mine)
    except FileNotFoundError:
        return True  # another process removed it first
    try:
        if mine.read_text() == text:
            return True
        try:
            os.link(mine, lease)  # a live holder's fresh lease: restored
        except FileExistsError:
            pass
        return False
    finally:
        mine.unlink(missing_ok=True)


def _take_lease(folder: Path, hold: bool) -> None:
    """The lock on a filesystem without ``flock`` (Lustre ``noflock``, NFS ``nolock``): a lease file
    naming the holder, created exclusively, refreshed by the holder, and removed however it ends on
    purpose (``exit_codes.before_exit``: at exit, and before ``os._exit``). A lease is over, and is
    taken over, when its process on this host has ended, when it was written by an earlier run of
    this SLURM job (requeued, perhaps on another host), or when it has not been refreshed for
    ``LEASE_EXPIRY_S``; otherwise it counts as live."""
    lease = folder / LEASE_FILE
    logger.warning(f"{folder} is on a filesystem without flock: using the lease file {lease} instead, which "
                   "cannot tell whether a run on another host is still alive (exclusion across hosts is weaker)")
    for _ in range(5):
        found = _read_lease(lease)
        if found is not None:
            text, age = found
            holder = _parse(text)
            if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                return  # this process holds it already
            reason = _ended(holder, age)
            if reason is None:
                raise DumpFolderInUse(
                    f"dump folder {folder} is in use by a run (pid {holder.get('pid')} on {holder.get('host')}, "
                    f"started {holder.get('started')}, from its lease file {lease}, refreshed {age:.0f} s ago); "
                    f"wait for it to end, or delete {lease} if that run is over")
            if not hold:
                return
            if not _remove_if_unchanged(lease, text):
                continue
            logger.warning(f"took over the lease {lease} of a run that is over: {reason}")
        elif not hold:
            return
        holder = _lease_holder()
        text = json.dumps(holder)
        if _create_exclusive(lease, text):
            _hold_lease(lease, text)
            return
    raise DumpFolderInUse(f"dump folder {folder}: another process keeps taking its lease file {lease}; "
                          "is another run starting there?")


def _hold_lease(lease: Path, text: str) -> None:
    def release():
        try:
            if lease.read_text() == text:
                lease.unlink()
        except OSError:
            pass

    def refresh():
        while True:
            time.sleep(LEASE_REFRESH_S)
            try:
                os.utime(lease)
            except OSError:
                return

    before_exit(release)
    threading.Thread(target=refresh, name="lease-refresh", daemon=True).start()
