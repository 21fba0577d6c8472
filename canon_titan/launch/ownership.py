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
EINVAL, ...), a pid/host lease file stands in for it, with a warning.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import errno
import fcntl
import json
import os
import signal
import socket
import sys
from pathlib import Path

from torchtitan.tools.logging import logger

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


def _take_lease(folder: Path, hold: bool) -> None:
    """The lock on a filesystem without ``flock`` (Lustre ``noflock``, NFS ``nolock``): a lease file
    naming the holder. A lease of a dead process on this host is stale and taken over; one from
    another host cannot be checked and counts as live until removed."""
    lease = folder / LEASE_FILE
    logger.warning(f"{folder} is on a filesystem without flock: using the lease file {lease} instead, which "
                   "cannot tell whether a run on another host is still alive (exclusion across hosts is weaker)")
    try:
        holder = json.loads(lease.read_text())
    except (OSError, ValueError):
        holder = None
    if holder and not (holder.get("host") == socket.gethostname() and not pid_alive(holder.get("pid"))) \
            and holder.get("pid") != os.getpid():
        raise DumpFolderInUse(f"dump folder {folder} is in use by a run (pid {holder.get('pid')} on "
                              f"{holder.get('host')}, started {holder.get('started')}, from its lease file {lease}); "
                              f"wait for it to end, or delete {lease} if that run is over")
    if hold:
        write_atomic(lease, json.dumps(_holder()))
        atexit.register(lease.unlink, missing_ok=True)
