"""How the ranks of a job agree, through the job's store rather than a collective: one barrier
(``store_barrier``), one decision taken by rank 0 for every rank (``rank_zero_decides``), and the
ranks' small results gathered on rank 0 (``gather_on_rank_zero``).

They go through the TCPStore that torchrun's agent serves (the default process group's, or the
launcher's before there is one): a rank waits with ``store.wait``, which the store's server
answers when the key is set, so a thousand waiting ranks make a thousand requests in all, not one
each per poll, and no collective's timeout runs while they wait (a rank still tuning its kernels
or evaluating may take far longer than ``[comm] train_timeout_seconds``). Keys are scoped by
torchrun's restart count and numbered per name, so every rank, calling in the same order, names
the same key.
"""

from __future__ import annotations

import os
import pickle
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")
_calls: Counter = Counter()


def _party(store) -> tuple[object | None, int, int]:
    """(store, this rank, world size): the given store with the environment's rank (a launcher
    before any process group), else the default group's; no store where one process runs alone."""
    if store is not None:
        return store, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None, 0, 1
    return dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()


def job_key(name: str) -> str:
    """A store key of this job's (torchrun restart's) own for the next use of ``name``: the n-th
    call with a name gives every rank the same key when the ranks call in the same order."""
    _calls[name] += 1
    return f"canon-titan/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}/{_calls[name]}"


def store_barrier(
    name: str, timeout: timedelta, *, parties: int | None = None, arrives: bool = True, store=None
) -> int:
    """Return once ``parties`` ranks (every rank of the job by default) have arrived at ``name``;
    how many had arrived when this one did. Each arrival is one ``add``; the last to arrive sets
    the key the others wait for. A rank that only waits for the others (``arrives=False``) is not
    counted. DistStoreError after ``timeout``."""
    store, _, world = _party(store)
    if store is None:
        return 1
    parties = world if parties is None else parties
    key = job_key(name)
    arrived = store.add(key, 1 if arrives else 0)
    if arrives and arrived == parties:
        store.set(f"{key}/all", "")
    else:
        store.wait([f"{key}/all"], timeout)
    return arrived


class RankZeroFailed(RuntimeError):
    """What the other ranks raise when rank 0 failed while deciding (rank 0 raises its own)."""


def rank_zero_decides(
    decide: Callable[[], T],
    name: str,
    *,
    refusals: tuple[type[Exception], ...] = (),
    timeout: timedelta | None = None,
    store=None,
) -> T:
    """``decide()`` run by rank 0 alone, and its result for every rank, or the refusal it raised
    (one of ``refusals``) raised on every rank: one rank reads a folder, tunes or evaluates, and
    every rank acts alike, none left waiting for a rank that stopped. Any other error stops every
    rank too (``RankZeroFailed`` on the others, naming it). The other ranks wait up to ``timeout``
    (the store's own when None). Every rank must call it, in the same order."""
    store, rank, _ = _party(store)
    if store is None:
        return decide()
    key = job_key(name)
    if rank == 0:
        failure = None
        try:
            answer = ("value", decide())
        except refusals as refusal:
            answer = ("raise", refusal)
        except Exception as e:  # anything else: every rank stops, none left waiting here
            failure = e
            why = f"rank 0 could not decide {name}: {type(e).__name__}: {e}"
            answer = ("raise", RankZeroFailed(why))
        store.set(key, pickle.dumps(answer))
        if failure is not None:
            raise failure
    else:
        if timeout is not None:
            store.wait([key], timeout)
        answer = pickle.loads(store.get(key))
    kind, value = answer
    if kind == "raise":
        raise value
    return value


def gather_on_rank_zero(value: T, name: str, *, timeout: timedelta) -> list[T] | None:
    """Every rank's small ``value`` (a few kilobytes: results, not weights), in rank order, on rank
    0; None on the others. Each rank sets a key of its own; rank 0 waits for them all (up to
    ``timeout``). Every rank must call it, in the same order."""
    store, rank, world = _party(None)
    if store is None:
        return [value]
    key = job_key(name)
    store.set(f"{key}/{rank}", pickle.dumps(value))
    if rank != 0:
        return None
    keys = [f"{key}/{r}" for r in range(world)]
    store.wait(keys, timeout)
    return [pickle.loads(store.get(k)) for k in keys]
