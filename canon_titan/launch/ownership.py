"""Who owns a training job's processes, and which job owns a dump folder.

``canon-titan train`` starts torchrun, torchrun starts the workers (each in a session of its own,
so a signal to the launcher's process group does not reach them). Both links are tied with Linux's
parent-death signal: torchrun gets SIGTERM when the launcher dies (and stops its workers as it
does for a SIGTERM), a worker gets SIGKILL when its torchrun agent dies. Whatever kills the
launcher, SIGKILL included, no worker trains on unseen.

A dump folder holds one live run. Global rank 0 keeps an exclusive ``flock`` on
``{dump_folder}/.canon-titan.lock`` for the run's life (the kernel drops it when the process dies,
however it dies) and, beside it, a lease file ``.canon-titan.lease`` naming the holder (host, pid
and when that process started, SLURM job, a random token). The flock alone does not keep out a run
on another node: on Lustre ``localflock``, BeeGFS's default and NFS ``local_lock=flock`` it succeeds
node-locally, and on Lustre ``noflock`` or NFS ``nolock`` it fails whatever the holder (any error
but "held by another"). So the lease is always written and checked: created exclusively, refreshed
by its holder, removed on every exit the process makes on purpose, and taken over only once its run
is over. A second run there stops before training naming the holder. The launcher checks the same
before it starts torchrun, and every node checks that it sees the lease rank 0 wrote
(``check_shared``): a folder that is not shared would take half of every checkpoint.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from torchtitan.tools.logging import logger

from canon_titan.components.exit_codes import before_exit
from canon_titan.tools.collectives import job_key, store_barrier
from canon_titan.tools.fileio import write_atomic

LOCK_FILE = ".canon-titan.lock"
LEASE_FILE = ".canon-titan.lease"
_PR_SET_PDEATHSIG = 1
_held: list = []


def die_with_parent(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux; elsewhere a
    no-op)."""
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


def lock_dump_folder(
    dump_folder: str | os.PathLike,
    *,
    hold: bool = True,
    on_lost: Callable[[str], None] | None = None,
) -> None:
    """Take the dump folder's run lock and lease (kept for the process's life when ``hold``; else
    only checked), or raise DumpFolderInUse naming the live run that has them, or DumpFolderUnusable
    when the lock file cannot be opened. ``on_lost(line)`` is called (from the refreshing thread) if
    another run takes the lease over while this process holds it."""
    folder = Path(dump_folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    try:
        handle = open(path, "a+")
    except OSError as e:
        raise DumpFolderUnusable(
            f"cannot open the lock file {path}: {e.strerror or e} (another user's folder, or "
            "read-only?); use a [job] dump_folder this user can write"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        handle.close()
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise DumpFolderInUse(
                f"dump folder {folder} is in use by a live run ({_describe_holder(folder)}); "
                "wait for it to end or stop it, or use another [job] dump_folder"
            ) from None
        handle = (
            None  # no working flock here, whatever it says: the lease alone keeps other runs out
        )
    try:
        _take_lease(folder, hold, on_lost)
    except BaseException:
        if handle is not None:
            handle.close()
        raise
    if handle is not None:
        if hold:
            _held.append(handle)
        else:
            handle.close()


def _describe_holder(folder: Path) -> str:
    try:
        holder = _parse((folder / LEASE_FILE).read_text())
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (OSError, TypeError, KeyError):
        return "another process"


LEASE_REFRESH_S = 30
"""How often the holder of a lease touches it (a thread), so that a reader on any host can tell a
live holder from one that died without removing it (SIGKILL, a lost node)."""
LEASE_EXPIRY_S = 150
"""A refreshed lease untouched for this long, held from another host by a run that SLURM does not
say is still running, belongs to a run that is over (five refreshes missed; the margin also covers
clocks of different hosts that disagree by a minute)."""
SLURM_LIVE_STATES = {
    "RUNNING",
    "SUSPENDED",
    "STOPPED",
    "COMPLETING",
    "CONFIGURING",
    "SIGNALING",
    "RESIZING",
    "STAGE_OUT",
}
"""squeue's states of a job that may still have processes: its lease is never taken, however long it
went unrefreshed (a suspended job refreshes nothing)."""


def _process_start(pid) -> int | None:
    """When process ``pid`` of this host started (clock ticks since boot, from Linux's /proc), so
    that a later process given the same pid does not pass for a lease's holder; None when there is
    none."""
    try:
        return int(Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError, TypeError):
        return None


def _lease_holder() -> dict:
    """What a lease records: the process, and the SLURM job and requeue count it belongs to."""
    return {
        "pid": os.getpid(),
        "pid_start": _process_start(os.getpid()),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "refresh_s": LEASE_REFRESH_S,
        "token": os.urandom(8).hex(),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_step": os.environ.get("SLURM_STEP_ID"),
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
    }


def _alive_here(holder: dict) -> bool:
    """Whether the lease's holder is a live process of this host (its pid, started when it says)."""
    start = _process_start(holder.get("pid"))
    return start is not None and start == holder.get("pid_start")


def _slurm_state(job: str) -> str | None:
    """SLURM's state of ``job`` as squeue gives it; None where squeue is missing or does not say."""
    if shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(
            ["squeue", "--noheader", "--jobs", str(job), "--format", "%T"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    states = out.stdout.split() if out.returncode == 0 else []
    return states[0] if states else None


def _judge(holder: dict | None, age: float) -> tuple[bool, str]:
    """Whether the run that wrote a lease is over, and why (or why it counts as live). ``age``:
    seconds since the lease was last touched."""
    if holder is None:
        return True, "the lease file is unreadable"
    pid, host = holder.get("pid"), holder.get("host")
    if host == socket.gethostname():
        if _alive_here(holder):
            return False, f"its process {pid} is alive on this host"
        return True, f"its process {pid} on this host has ended"
    job = os.environ.get("SLURM_JOB_ID")
    if job and holder.get("slurm_job") == job:
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        if int(holder.get("slurm_restart") or 0) < restart:
            return True, (
                f"it was written before SLURM requeued job {job} "
                f"(requeue {holder.get('slurm_restart')} < {restart})"
            )
        if holder.get("slurm_step") == os.environ.get("SLURM_STEP_ID"):
            return (
                True,
                f"it was written on another node of this job step (SLURM job {job}), not "
                "by another run",
            )
    if not holder.get("refresh_s"):
        return False, "it does not say that it is refreshed, so its age tells nothing"
    if age <= LEASE_EXPIRY_S:
        return (
            False,
            f"refreshed {age:.0f} s ago; another host's lease is over once unrefreshed for "
            f"{LEASE_EXPIRY_S} s",
        )
    other_job = holder.get("slurm_job")
    state = _slurm_state(other_job) if other_job and other_job != job else None
    if state in SLURM_LIVE_STATES:
        return (
            False,
            f"its SLURM job {other_job} is {state}, though the lease went unrefreshed for "
            f"{age:.0f} s",
        )
    return (
        True,
        f"it has not been refreshed for {age:.0f} s (its holder refreshes it every "
        f"{holder['refresh_s']} s)",
    )


def _read_lease(lease: Path) -> tuple[str, float] | None:
    """The lease's text and seconds since it was last touched, or None when there is none."""
    try:
        with open(lease) as f:
            return f.read(), time.time() - os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DumpFolderUnusable(
            f"cannot read the lease file {lease}: {e.strerror or e}; use a [job] dump_folder "
            "this user can write"
        ) from None


def _parse(text: str) -> dict | None:
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _create_exclusive(lease: Path, text: str) -> bool:
    """Create ``lease`` holding ``text`` unless it exists: a complete temporary file hard-linked to
    the name (link fails when the name exists, atomically even on NFS, and no reader ever sees a
    half-written lease). False when another process has it. On NFS the LINK call is not
    idempotent: when its reply is lost, the client's retransmission answers EEXIST although the
    first made the link; the temporary file's link count tells (2: the link is this process's;
    open(2)'s recipe)."""
    tmp = lease.with_name(f"{lease.name}.{socket.gethostname()}.{os.getpid()}.new")
    try:
        write_atomic(tmp, text)
        os.link(tmp, lease)
        return True
    except FileExistsError:
        return os.stat(tmp).st_nlink == 2
    except OSError as e:  # a full disk, or a filesystem without hard links (some FUSE mounts)
        raise DumpFolderUnusable(
            f"cannot create the lease file {lease}: {e.strerror or e}; use a [job] dump_folder "
            "with free space, on a POSIX filesystem (NFS, Lustre, GPFS, BeeGFS, a local disk)"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)


def _remove_if_unchanged(lease: Path, text: str) -> bool:
    """Remove the lease judged stale, unless another process replaced it meanwhile: it is renamed
    to a name of this process's own (only one remover wins), compared, and put back if it
    changed."""
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


def _take_lease(folder: Path, hold: bool, on_lost: Callable[[str], None] | None = None) -> None:
    """The lease: naming the holder, created exclusively, refreshed by the holder, and removed
    however it ends on purpose (``exit_codes.before_exit``: at exit, and before ``os._exit``). It is
    never taken from a live process of this host, nor from a job squeue says is running; it is over,
    and taken over, when its process on this host has ended, when an earlier run of this SLURM job
    wrote it (requeued, perhaps on another host), or when it has not been refreshed for
    ``LEASE_EXPIRY_S``."""
    lease = folder / LEASE_FILE
    for _ in range(5):
        found = _read_lease(lease)
        if found is not None:
            text, age = found
            holder = _parse(text)
            here = holder is not None and holder.get("host") == socket.gethostname()
            if here and holder.get("pid") == os.getpid():
                return  # this process holds it already
            over, why = _judge(holder, age)
            if not over:
                raise DumpFolderInUse(
                    f"dump folder {folder} is in use by a run (pid {holder.get('pid')} on "
                    f"{holder.get('host')}, "
                    f"started {holder.get('started')}, from its lease file {lease}: "
                    f"{why}); wait for it to end or "
                    "stop it, or use another [job] dump_folder"
                    + ("" if here else f"; delete {lease} if it is over")
                )
            if not hold:
                return
            if not _remove_if_unchanged(lease, text):
                continue
            logger.warning(f"took over the lease {lease} of a run that is over: {why}")
        elif not hold:
            return
        text = json.dumps(_lease_holder())
        if _create_exclusive(lease, text):
            _hold_lease(lease, text, on_lost)
            return
    raise DumpFolderInUse(
        f"dump folder {folder}: another process keeps taking its lease file {lease}; "
        "is another run starting there?"
    )


def _hold_lease(lease: Path, text: str, on_lost: Callable[[str], None] | None) -> None:
    released = threading.Event()

    def release():
        released.set()
        try:
            if lease.read_text() == text:
                lease.unlink()
        except OSError:
            pass

    def refresh():
        while not released.wait(LEASE_REFRESH_S):
            try:
                with open(lease) as f:
                    if f.read() != text:  # taken over: never touch another run's lease
                        break
                    os.utime(f.fileno())
            except FileNotFoundError:
                break
            except OSError:
                return
        if not released.is_set():
            line = (
                f"the lease {lease} is no longer this run's ({_describe_holder(lease.parent)} "
                "holds it, or it was deleted): another run may write into the same dump "
                "folder; this run stops before its next save, so that the two do not write "
                "checkpoints side by side"
            )
            logger.error(line)
            if on_lost is not None:
                on_lost(line)

    before_exit(release)
    threading.Thread(target=refresh, name="lease-refresh", daemon=True).start()


def held_lease_token(dump_folder: str | os.PathLike) -> str | None:
    """The token of the lease this process holds on ``dump_folder``, or None."""
    found = _read_lease(Path(dump_folder) / LEASE_FILE)
    holder = _parse(found[0]) if found else None
    if (
        holder is None
        or holder.get("host") != socket.gethostname()
        or holder.get("pid") != os.getpid()
    ):
        return None
    return holder.get("token")


SHARED_LOOKS = 3
"""How often a node looks for rank 0's lease, a second apart, before it says it does not see it: an
NFS client may answer a lookup from its cache of names for a moment (listing the folder first
revalidates it)."""
SHARED_WAIT = datetime.timedelta(minutes=10)
"""How long a rank waits for every node to have looked for the lease."""


def check_shared(store, dump_folder: str | os.PathLike, token: str) -> str | None:
    """On several nodes: whether every node sees the dump folder whose lease rank 0 holds
    (``token``: that lease's), or one line saying that some do not and how to fix it. Local rank 0
    of each node reads the lease and says through ``store`` (torchrun's) whether it saw it; every
    rank waits until every node has looked and reads the same count, so none trains while another
    refuses. A folder
    each node has of its own (a node-local disk, a path mounted on some nodes only) would take half
    of every checkpoint, and the run would end as if saved."""
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if nodes == 1:
        return None
    blind, first_blind = job_key("dump-folder-blind"), job_key("dump-folder-first-blind")
    looks = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if looks and not _sees(Path(dump_folder) / LEASE_FILE, token):
        store.compare_set(first_blind, "", socket.gethostname())
        store.add(blind, 1)
    store_barrier("dump-folder-seen", SHARED_WAIT, parties=nodes, arrives=looks, store=store)
    unseen = store.add(blind, 0)
    if not unseen:
        return None
    first = store.get(first_blind).decode()
    return (
        f"dump folder {dump_folder} is not shared by every node: {unseen} of {nodes} nodes "
        f"(the first: {first}) do not see the lease file {LEASE_FILE} that rank 0 wrote in "
        "it; put [job] dump_folder on a filesystem every node mounts at the same path (NFS, "
        "Lustre, GPFS, ...)"
    )


def _sees(lease: Path, token: str) -> bool:
    for look in range(SHARED_LOOKS):
        if look:
            time.sleep(1)
        try:
            os.listdir(lease.parent)
            found = _read_lease(lease)
        except (OSError, DumpFolderUnusable):
            continue
        if found is not None and (_parse(found[0]) or {}).get("token") == token:
            return True
    return False
